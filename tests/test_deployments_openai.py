"""A `loops deploy` endpoint driven by the official `openai` package, as real clients do:
logprobs in the chat and completions shapes (the same numbers `loops sample -o json` reports
for the same prompt and seed), token-by-token streaming (the first chunk provably arrives
while the sampler is still decoding; each token's logprobs with its text), the usage chunk,
echo + logprobs scoring (the trainer's `/forward` numbers), batched prompts with `n`, the model
name as a model id, roles and tools, and every malformed request's status and OpenAI error
object (401 and 500 too, on a connection kept alive), the body cap and `/health` during a 20 MB
prompt (event orders, no timing)."""

from __future__ import annotations

import openai
import pytest

from tests.cli_support import QUESTION, SECRET, api, loops, seeded  # noqa: F401  (fixture)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def deployed(seeded) -> dict:
    result = loops(seeded.server, "deploy", f"{seeded.run_id}:s2", "--model-name", "openai-test", "-o", "json")
    assert result.code == 0, result
    return result.json()


@pytest.fixture(scope="module")
def client(seeded, deployed) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployed["url"], api_key=seeded.server.token, max_retries=0, timeout=120)


def _loops_sample(seeded, *args: str) -> dict:
    result = loops(seeded.server, "sample", f"{seeded.run_id}:s2", "-T", "0", "--seed", "7",
                   "--max-tokens", str(MAX_TOKENS), "-o", "json", *args)
    assert result.code == 0, result
    return result.json()["samples"][0]


def test_chat_logprobs_are_the_samplers(seeded, client):
    answer = client.chat.completions.create(
        model="s2", messages=[{"role": "user", "content": QUESTION}], temperature=0, seed=7,
        max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    assert choice.message.content.startswith(SECRET)
    content = choice.logprobs.content
    # Every generated token is listed, the stop token that ended the reply too (as OpenAI and
    # vLLM list it), though its text is not in the reply.
    assert choice.finish_reason == "stop" and content[-1].token == "<|im_end|>"
    assert "".join(entry.token for entry in content[:-1]) == choice.message.content
    reference = _loops_sample(seeded, "--chat", "--prompt", QUESTION)
    assert len(content) == len(reference["tokens"])
    for entry, logprob in zip(content, reference["logprobs"]):
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the top token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    plain = client.chat.completions.create(model="s2", messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_completion_logprobs_are_the_samplers(seeded, client):
    answer = client.completions.create(model="s2", prompt="The password", temperature=0, seed=7,
                                       max_tokens=MAX_TOKENS, logprobs=2)
    choice = answer.choices[0]
    lp = choice.logprobs
    reference = _loops_sample(seeded, "--prompt", "The password")
    assert lp.token_logprobs == pytest.approx(reference["logprobs"][:len(lp.tokens)], abs=1e-4)
    assert len(lp.tokens) == len(reference["tokens"])
    if choice.finish_reason == "stop":  # the stop token is listed; its text is not in the reply
        assert lp.tokens[-1] in ("<|eos|>", "<|im_end|>") and "".join(lp.tokens[:-1]) == choice.text
    else:
        assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(logprob, abs=1e-6)
        assert top.get(token) == pytest.approx(logprob, abs=1e-6)


def test_chat_streams_token_by_token_while_the_sampler_decodes(seeded, client):
    server = seeded.server
    reference = client.chat.completions.create(model="s2", messages=[{"role": "user", "content": QUESTION}],
                                               temperature=0, max_tokens=MAX_TOKENS)
    # Decoding pauses after the first token until the faults are cleared: whatever arrives
    # before that was sent while generation was provably unfinished.
    api(server, "POST", "/v1/local/faults", json={"job": "sample *", "pause_after_tokens": 1})
    try:
        stream = client.chat.completions.create(
            model="s2", messages=[{"role": "user", "content": QUESTION}], temperature=0,
            max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        role = next(chunks)
        assert role.choices[0].delta.role == "assistant" and role.usage is None
        first = next(chunks)
        assert first.choices[0].delta.content and first.choices[0].finish_reason is None
        jobs = {w["model"]: w for w in api(server, "GET", "/v1/local/status")["models"]}
        assert any((w["current_job"] or "").startswith("sample") for w in jobs.values()), jobs
    finally:
        api(server, "DELETE", "/v1/local/faults")
    rest = list(chunks)
    usage_chunk = rest[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == reference.usage.completion_tokens
    body = [first, *rest[:-1]]
    contents = [c.choices[0].delta.content for c in body if c.choices[0].delta.content]
    assert len(contents) > 1
    assert "".join(contents) == reference.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body][-1] == reference.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_completions_stream_with_logprobs_and_usage(client):
    reference = client.completions.create(model="s2", prompt="The password", temperature=0, max_tokens=MAX_TOKENS,
                                          logprobs=1)
    chunks = list(client.completions.create(model="s2", prompt="The password", temperature=0, max_tokens=MAX_TOKENS,
                                            logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == reference.usage.total_tokens
    body = chunks[:-1]
    assert len([c for c in body if c.choices[0].text]) > 1
    assert "".join(c.choices[0].text for c in body) == reference.choices[0].text
    streamed = [lp for c in body if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(reference.choices[0].logprobs.token_logprobs, abs=1e-6)
    offsets = [o for c in body if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == reference.choices[0].logprobs.text_offset
    assert body[-1].choices[0].finish_reason == reference.choices[0].finish_reason


@pytest.mark.parametrize("params, named", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_an_unimplemented_parameter_is_a_400_naming_it(client, params, named):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="s2", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **params)
    assert named in str(caught.value)
    assert caught.value.body["param"] == named  # the OpenAI error shape


def test_neutral_values_and_completion_parameters(client):
    ok = client.chat.completions.create(model="s2", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        presence_penalty=0, frequency_penalty=0, logit_bias={}, user="u1")
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="s2", prompt="hi", max_tokens=2, suffix="!")
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model="s2", prompt="hi", max_tokens=2, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="s2", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       top_logprobs=2)


def test_a_samplers_sample_streams_through_the_sampler_client(seeded):
    """The sampler's own `/sample` (token ids, what `loops sample --stream` uses) streams too."""
    from baseten_loops_cli.tokenization import get_tokenizer, render_chat
    from baseten_loops_cli.workers.sampler import SamplerClient

    run = api(seeded.server, "GET", f"/v1/loops/runs/{seeded.run_id}")["run"]
    tokenizer = get_tokenizer(run["base_model"])
    prompt, _ = render_chat(tokenizer, [{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    pin = f"bt://loops:{seeded.run_id}/sampler_weights/s2"
    stops = list(tokenizer.stop_token_ids)
    with SamplerClient(run["sampler"]["base_url"], api_key=seeded.server.token, run_id=seeded.run_id) as sc:
        whole = sc.sample(list(prompt), max_tokens=MAX_TOKENS, temperature=0, stop=stops, checkpoint_path=pin)
        chunks = list(sc.sample_stream(list(prompt), max_tokens=MAX_TOKENS, temperature=0, stop=stops,
                                       checkpoint_path=pin))
    seq = whole.sequences[0]
    assert [t for c in chunks for t in c.token_ids] == seq.tokens
    assert len([c for c in chunks if c.text]) > 1
    text = "".join(c.text for c in chunks)
    assert text.startswith(SECRET) and text == tokenizer.decode([t for t in seq.tokens if t not in stops])
    assert chunks[-1].finish_reason == ("stop" if seq.stop_reason == "stop" else "length")


def test_a_stop_string_is_never_streamed(client):
    """Text that could be the start of a stop string is held back until it is known not to be."""
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="s2", messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                           stop=["fish"])
    assert whole.choices[0].message.content == SECRET[:SECRET.index("fish")]
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="s2", messages=messages, temperature=0,
                                                 max_tokens=MAX_TOKENS, stop=["fish"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def _forward_logprobs(seeded, prompts: list[list[int]]) -> list[list[float]]:
    """The trainer's `/forward` logprobs of each prompt's tokens 1.. (the seeded run's weights
    are its checkpoint s2's: nothing trains it after s2)."""
    from tests.cli_support import trainer

    data = [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
             "loss_fn_inputs": {"target_tokens": {"data": ids[1:], "dtype": "int64", "shape": [len(ids) - 1]},
                                "weights": {"data": [1.0] * (len(ids) - 1), "dtype": "float32",
                                            "shape": [len(ids) - 1]}}} for ids in prompts]
    with trainer(seeded.server, seeded.run_id) as tc:
        out = tc.forward(data, "cross_entropy").result(timeout=120)
    return [list(row["logprobs"]["data"]) for row in out["loss_fn_outputs"]]


def test_echo_scores_prompts_with_the_trainers_forward_logprobs(seeded, client):
    """How evaluation harnesses score loglikelihood: echo + logprobs + max_tokens 0, a batch
    of token-id lists; the numbers are the trainer's `/forward` ones."""
    from baseten_loops_cli.tokenization import get_tokenizer

    tokenizer = get_tokenizer(seeded.base_model)
    texts = [f"{QUESTION} {SECRET}", "The password is"]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = _forward_logprobs(seeded, prompts)
    answer = client.completions.create(model="s2", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.prompt_tokens == sum(map(len, prompts)) and answer.usage.completion_tokens == 0
    for choice, ids, text, reference in zip(answer.choices, prompts, texts, expected):
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length"
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(reference, abs=1e-4)
        for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) == 1 and max(top.values()) >= logprob - 1e-6
    # A string prompt, echoed before a completion: the prompt's part is the same numbers.
    scored = client.completions.create(model="s2", prompt=texts[0], max_tokens=3, echo=True, logprobs=0,
                                       temperature=0)
    choice = scored.choices[0]
    assert choice.logprobs.token_logprobs[1:len(prompts[0])] == pytest.approx(expected[0], abs=1e-4)
    plain = client.completions.create(model="s2", prompt=texts[0], max_tokens=3, temperature=0, logprobs=0)
    assert choice.text == texts[0] + plain.choices[0].text
    assert choice.logprobs.token_logprobs[len(prompts[0]):] == plain.choices[0].logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError, match="echo") as caught:
        client.completions.create(model="s2", prompt=texts[0], max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def _reply_to_the_stop_token(tokenizer) -> list[int]:
    """The chat of QUESTION with the reply SECRET, up to (not with) the reply's end-of-turn
    token: s2's greedy next token there is that stop token."""
    from baseten_loops_cli.tokenization import render_chat

    tokens, _ = render_chat(tokenizer, [{"role": "user", "content": QUESTION},
                                        {"role": "assistant", "content": SECRET}])
    last = max(i for i, t in enumerate(tokens) if t in tokenizer.stop_token_ids)
    return list(tokens[:last + 1])


def test_a_generated_stop_token_is_listed_in_the_logprobs_in_every_combination(seeded, client):
    """Issue 43: lm-eval's loglikelihood sends echo + logprobs 1 + max_tokens 1 and drops the
    last logprob as the generated token. When that token is the stop token it must be listed
    (text, logprob, top, offset) like any other generated token, though the text leaves it
    out: else the continuation's real last token is dropped. Echo, n, streaming, chat."""
    from baseten_loops_cli.tokenization import get_tokenizer

    tokenizer = get_tokenizer(seeded.base_model)
    with_stop = _reply_to_the_stop_token(tokenizer)
    prompt = with_stop[:-1]
    assert with_stop[-1] in tokenizer.stop_token_ids
    expected = _forward_logprobs(seeded, [with_stop])[0]  # the trainer's, the stop token's last
    text = tokenizer.decode(prompt)
    for n in (1, 2):
        answer = client.completions.create(model="s2", prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                           temperature=0, n=n)
        assert answer.usage.completion_tokens == n
        for choice in answer.choices:
            lp = choice.logprobs
            assert choice.finish_reason == "stop" and choice.text == text  # the text leaves it out
            assert len(lp.tokens) == len(prompt) + 1 and lp.tokens[-1] == "<|im_end|>"
            assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
            assert lp.top_logprobs[-1] == {"<|im_end|>": pytest.approx(expected[-1], abs=1e-4)}
            assert lp.text_offset[-1] == lp.text_offset[-2] + len(lp.tokens[-2]) == len(text)
            # lm-eval's reading: the continuation's logprobs are [ctxlen:-1]
            assert sum(lp.token_logprobs[len(prompt) - 1:-1]) == pytest.approx(expected[-2], abs=1e-4)
    generated = client.completions.create(model="s2", prompt=prompt, max_tokens=4, logprobs=2, temperature=0)
    choice = generated.choices[0]
    assert choice.text == "" and choice.logprobs.tokens == ["<|im_end|>"]
    assert choice.logprobs.token_logprobs == pytest.approx(expected[-1:], abs=1e-4)
    streamed = list(client.completions.create(model="s2", prompt=prompt, max_tokens=4, logprobs=2, temperature=0,
                                              stream=True))
    listed = [(t, lp) for c in streamed if c.choices and c.choices[0].logprobs
              for t, lp in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)]
    assert listed == [("<|im_end|>", pytest.approx(expected[-1], abs=1e-4))]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ""
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"
    chat = list(client.chat.completions.create(model="s2", messages=[{"role": "user", "content": QUESTION}],
                                               temperature=0, max_tokens=16, logprobs=True, stream=True))
    entries = [e.token for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert entries[-1] == "<|im_end|>" and "".join(entries[:-1]) == "".join(
        c.choices[0].delta.content or "" for c in chat if c.choices)


@pytest.mark.parametrize("form", ["strings", "token lists"])
def test_a_batch_of_three_prompts_with_n_2_is_indexed_as_openai_does(seeded, client, form):
    from baseten_loops_cli.tokenization import get_tokenizer

    texts = ["The password", QUESTION, "hello"]
    prompt = texts if form == "strings" else [get_tokenizer(seeded.base_model).encode(t) for t in texts]
    batch = client.completions.create(model="s2", prompt=prompt, n=2, max_tokens=4, temperature=0, logprobs=1)
    assert [c.index for c in batch.choices] == list(range(6))
    completion_tokens = 0
    for i, text in enumerate(texts):
        alone = client.completions.create(model="s2", prompt=text, max_tokens=4, temperature=0)
        assert [batch.choices[2 * i + j].text for j in range(2)] == [alone.choices[0].text] * 2
        completion_tokens += 2 * alone.usage.completion_tokens
    assert batch.usage.prompt_tokens == sum(len(t.encode()) for t in texts)  # bytes: the tiny tokenizer
    assert batch.usage.completion_tokens == completion_tokens
    streamed = list(client.completions.create(model="s2", prompt=prompt, n=2, max_tokens=4, temperature=0,
                                              stream=True))
    texts_by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts_by_index[c.index] = texts_by_index.get(c.index, "") + c.text
    assert texts_by_index == {c.index: c.text for c in batch.choices}


def test_the_model_name_is_a_model_id_listed_by_v1_models(seeded, client, deployed):
    assert deployed["model_name"] == "openai-test"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["openai-test", "s2", seeded.base_model]
    messages = [{"role": "user", "content": QUESTION}]
    by_name = client.chat.completions.create(model="openai-test", messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    assert by_name.model == "openai-test" and by_name.choices[0].message.content.startswith(SECRET)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=messages, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert "openai-test" in caught.value.body["message"]


def _stream_pieces(chunks, text_of, logprobs_of):
    """(text, logprob tokens) of every chunk but the finish one, and the finish chunk."""
    body = [c for c in chunks if c.choices]
    return [(text_of(c.choices[0]), logprobs_of(c.choices[0])) for c in body[:-1]], body[-1].choices[0]


def test_streamed_logprobs_travel_with_their_text(client):
    """A reply cut by `length`: every token's logprobs come in the chunk carrying its text,
    and the finish chunk carries no logprobs (chat and completions)."""
    messages = [{"role": "user", "content": QUESTION}]
    chat = list(client.chat.completions.create(model="s2", messages=messages, temperature=0, max_tokens=4,
                                               logprobs=True, stream=True))
    pieces, finish = _stream_pieces(
        chat, lambda c: c.delta.content, lambda c: [e.token for e in c.logprobs.content] if c.logprobs else None)
    assert finish.finish_reason == "length" and finish.logprobs is None and not finish.delta.content
    tokens = [(text, toks) for text, toks in pieces if toks is not None]
    assert len(tokens) == 4 and all("".join(toks) == text for text, toks in tokens), pieces
    assert "".join(text for text, _ in pieces if text) == SECRET[:4]
    completion = list(client.completions.create(model="s2", prompt="The password", temperature=0, max_tokens=4,
                                                logprobs=1, stream=True))
    pieces, finish = _stream_pieces(completion, lambda c: c.text, lambda c: c.logprobs.tokens if c.logprobs else None)
    assert finish.finish_reason == "length" and finish.logprobs is None and finish.text == ""
    assert [len(toks) for _, toks in pieces] == [1, 1, 1, 1]
    assert all("".join(toks) == text for text, toks in pieces)


def test_roles_content_parts_and_an_assistant_first_conversation(client):
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": QUESTION}], "name": "ann"}]
    answers = [client.chat.completions.create(model="s2", messages=m, temperature=0, max_tokens=MAX_TOKENS)
               for m in (plain, parts)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    opening = client.chat.completions.create(
        model="s2", temperature=0, max_tokens=4,
        messages=[{"role": "assistant", "content": "Hi! Ask me."}, {"role": "user", "content": QUESTION}])
    assert opening.choices[0].finish_reason in ("stop", "length")


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
# (request fields, status, error.param, words of the message): what the tiny model's endpoint
# answers; the bad-input corpus (tests/data/bad/cases.yaml) has the raw-HTTP ones.
MALFORMED = [
    ({"messages": [{"role": "bogus", "content": "hi"}]}, 400, "messages[0].role", "is not one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]", "text parts only"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string or a list of text parts"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, 400, "messages[0].tool_call_id",
     "does not take"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}, 400,
     "messages[1].tool_call_id", "needs tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "c9"}]},
     400, "messages[1].tool_call_id", "answers no earlier"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "content": "42", "tool_call_id": "call_1"}]}, 400, "messages[1].tool_calls",
     "template has no tools"),
    ({"tools": [TOOL]}, 400, "tools", "template has no tools"),
    ({"tool_choice": "required", "tools": [TOOL]}, 400, "tool_choice", "cannot force"),
    ({"messages": []}, 400, "messages", "non-empty list"),
    ({"n": 0}, 400, "n", "n must be"),
    ({"temperature": 7}, 400, "temperature", "temperature must be"),
    ({"max_tokens": 100000}, 400, "messages", "exceeds the maximum length"),
    ({"stop": [1]}, 400, "stop", "stop must be"),
    ({"logprobs": "yes"}, 400, "logprobs", "true or false"),
    ({"model": "missing"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("fields, status, param, words", MALFORMED, ids=[m[2] + ":" + m[3] for m in MALFORMED])
def test_a_malformed_chat_request_gets_openais_error_object(client, fields, status, param, words):
    request = {"model": "s2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    error = caught.value
    assert error.status_code == status and words in error.message
    assert set(error.body) == {"message", "type", "param", "code"} and error.body["param"] == param
    assert error.body["type"] == "invalid_request_error" and error.body["code"]


@pytest.mark.parametrize("fields, param, words", [
    ({"prompt": [1, "a"]}, "prompt", "token-id lists"),
    ({"prompt": [[1, 2], []]}, "prompt[1]", "is empty"),
    ({"prompt": [[1, 2], [99999]]}, "prompt[1]", "outside"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "echo", "cannot be streamed"),
    ({"prompt": "hi", "echo": "yes"}, "echo", "true or false"),
])
def test_a_malformed_completion_request_gets_openais_error_object(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="s2", max_tokens=2, **fields)
    assert words in caught.value.message and caught.value.body["param"] == param


def test_401_and_500_carry_the_error_object_and_keep_the_connection(seeded, deployed):
    """Each error either leaves the kept-alive connection usable or says `Connection: close`;
    a plain keep-alive client never meets a silently closed connection."""
    import http.client
    import json
    from urllib.parse import urlsplit

    url = urlsplit(deployed["url"])
    auth = {"Authorization": f"Bearer {seeded.server.token}", "Content-Type": "application/json"}
    good = json.dumps({"model": "s2", "prompt": "hi", "max_tokens": 1})
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)

    def send(body: str | bytes, headers: dict) -> tuple[int, dict]:
        nonlocal conn
        conn.request("POST", f"{url.path}/completions", body=body, headers=headers)
        response = conn.getresponse()
        data = json.loads(response.read())
        if (response.getheader("Connection") or "").lower() == "close":
            conn.close()
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        return response.status, data

    api(seeded.server, "POST", "/v1/local/faults", json={"job": "sample *", "error": "boom"})
    try:
        status, body = send(good, auth)
    finally:
        api(seeded.server, "DELETE", "/v1/local/faults")
    assert status == 500 and body["error"]["type"] == "server_error" and "boom" in body["error"]["message"]
    assert send(good, auth)[0] == 200
    status, body = send(good, {**auth, "Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and body["error"]["message"]
    assert send(good, auth)[0] == 200
    status, body = send('{"prompt": ' + "[" * 10_000 + "]" * 10_000 + "}", auth)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    status, body = send('{"model": "s2", "prompt": "\\ud800", "max_tokens": 1}', auth)
    assert status == 400 and body["error"]["param"] == "prompt" and "surrogate" in body["error"]["message"]
    assert send(good, auth)[0] == 200
    conn.close()


def test_a_body_over_the_cap_is_a_413_before_it_is_sent(seeded, deployed):
    """The server answers from the headers alone: the body is never sent."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(deployed["url"])
    with socket.create_connection((url.hostname, url.port), timeout=120) as sock:
        sock.sendall((f"POST {url.path}/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
                      f"Authorization: Bearer {seeded.server.token}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {64 * 2**20}\r\n\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert b'"code":"request_too_large"' in body.replace(b" ", b"")


def test_health_answers_while_a_20_mb_prompt_is_being_tokenized(seeded, deployed):
    """Event order, no timing: the prompt's tokenization is held (a test fault on its worker
    thread) while /health answers; a tokenizer on the event loop would hold /health too."""
    import threading

    import httpx

    from tests.cli_support import wait_for

    server = seeded.server
    api(server, "POST", "/v1/local/faults", json={"job": "tokenize *", "delay_s": 120})
    answers: dict[str, httpx.Response] = {}

    def big_request() -> None:
        answers["big"] = httpx.post(f"{deployed['url']}/completions", timeout=300,
                                    headers={"Authorization": f"Bearer {server.token}"},
                                    json={"model": "s2", "prompt": "a" * 20_000_000, "max_tokens": 1})

    thread = threading.Thread(target=big_request)
    thread.start()
    try:
        wait_for(lambda: api(server, "GET", "/v1/local/faults")["faults"] == [], timeout=120)  # taken: held
        health = httpx.get(f"{server.url}/health", timeout=60)
        assert health.status_code == 200 and "big" not in answers
    finally:
        api(server, "DELETE", "/v1/local/faults")
        thread.join(300)
    assert answers["big"].status_code == 400
    assert answers["big"].json()["error"]["code"] == "context_length_exceeded"


# A template in the style of Qwen's / Llama 3.1's: tool definitions in the system turn, tool
# calls as JSON, tool results as their own turns; and SmolLM2's, which adds a system turn when
# the conversation does not open with one (so a prefix of it renders differently).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _template_tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from baseten_loops_cli.tokenization.files import FileTokenizer

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_end|>": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return FileTokenizer("test/tools", raw, {"eos_token": "<|im_end|>"}, template)


def test_tools_and_tool_calls_go_through_a_template_that_has_them():
    from baseten_loops_cli.local.server.openai_requests import render_chat_prompt as _render

    tokenizer = _template_tokenizer(TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    rendered: list[str] = []
    tokenizer.encode = lambda text: rendered.append(text) or [0]  # the text the model would see
    _render(tokenizer, messages, {"tools": [TOOL]})
    assert rendered == ['<|im_start|>system\nTools: [{"type": "function", "function": {"name": "lookup", '
                        '"parameters": {"type": "object", "properties": {}}}}]<|im_end|>\n<|im_start|>user\nhi'
                        '<|im_end|>\n<|im_start|>assistant\n<tool_call>{"name": "lookup", "arguments": {}}'
                        '</tool_call><|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n']


def test_an_assistant_first_conversation_renders_for_serving():
    """The training-side check (a prefix renders as in the whole) does not run when serving:
    SmolLM2's template adds a system turn before an opening assistant message."""
    from baseten_loops_cli.local.server.openai_requests import render_chat_prompt as _render
    from baseten_loops_cli.tokenization import render_chat

    tokenizer = _template_tokenizer(SMOL_TEMPLATE)
    messages = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="prefix"):
        render_chat(tokenizer, messages, add_generation_prompt=True)
    rendered: list[str] = []
    tokenizer.encode = lambda text: rendered.append(text) or [0]
    _render(tokenizer, messages, {})
    assert rendered == ["<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
