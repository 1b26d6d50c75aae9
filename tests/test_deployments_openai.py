"""A `loops deploy` endpoint driven by the official `openai` package, as real clients do:
logprobs in the chat and completions shapes (the same numbers `loops sample -o json` reports
for the same prompt and seed), token-by-token streaming (the first chunk provably arrives
while the sampler is still decoding), the usage chunk, and a 400 naming a parameter the
endpoint does not implement."""

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
    assert "".join(entry.token for entry in content) == choice.message.content
    reference = _loops_sample(seeded, "--chat", "--prompt", QUESTION)
    assert len(content) in (len(reference["tokens"]), len(reference["tokens"]) - 1)  # minus a stop token
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
    assert len(lp.tokens) >= len(reference["tokens"]) - 1 and "".join(lp.tokens) == choice.text
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
