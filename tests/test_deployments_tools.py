"""Tool calls and reasoning in a deployment's chat replies, as vLLM's Hermes tool parser and
reasoning parser return them, driven by the official `openai` package against a real local
server. The model is a folder of the tiny model whose chat template renders tools
(Qwen/Hermes style, written here) and `enable_thinking`; a short SFT teaches it to answer one
question with a tool call and another with a `<think>` block, so the replies parsed are ones
the sampler really generated."""

from __future__ import annotations

import json

import openai
import pytest

from tests.cli_support import api, loops, trainer

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{%- endif %}")
# Short, so that a few SFT steps teach the tiny model the call.
TOOL = {"type": "function", "function": {"name": "pw", "parameters": {}}}
ASK = [{"role": "user", "content": "pw?"}]
CALL_REPLY = '<tool_call>\n{"name": "pw", "arguments": {}}\n</tool_call>'
THINK = [{"role": "user", "content": "think"}]
THINK_REPLY = "<think>hmm</think>ok"


def _tiny_folder_with_tools(path):
    from baseten_loops_cli.local.engine.model_zoo import build_tiny_model
    from baseten_loops_cli.tokenization.byte_tokenizer import tokenizer_files

    model = build_tiny_model()
    model.save_pretrained(path)
    for name, text in tokenizer_files(model.config.max_position_embeddings).items():
        if name == "tokenizer_config.json":
            config = json.loads(text)
            config["chat_template"] = TOOLS_TEMPLATE
            text = json.dumps(config)
        (path / name).write_text(text)
    return path


def _datum(tokenizer, messages, reply, tools=None) -> dict:
    prompt = tokenizer.encode(tokenizer.apply_chat_template_text(messages, True, tools=tools))
    tokens = prompt + tokenizer.encode(reply + "<|im_end|>")
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
    n = len(tokens) - 1
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
                               "weights": {"data": weights, "dtype": "float32", "shape": [n]}}}


@pytest.fixture(scope="module")
def client(local_server, tmp_path_factory) -> openai.OpenAI:
    from baseten_loops_cli.tokenization import get_tokenizer

    folder = str(_tiny_folder_with_tools(tmp_path_factory.mktemp("tiny-tools")))
    tokenizer = get_tokenizer(folder)
    assert tokenizer.chat_template == TOOLS_TEMPLATE
    session = api(local_server, "POST", "/v1/loops/sessions", json={})["session"]["id"]
    run = api(local_server, "POST", "/v1/loops/runs",
              json={"session_id": session, "base_model": folder, "lora_rank": 16, "seed": 0})["run"]
    data = [_datum(tokenizer, ASK, CALL_REPLY, [TOOL]), _datum(tokenizer, THINK, THINK_REPLY)]
    with trainer(local_server, run["id"]) as tc:
        tc.base_model = folder
        for _ in range(60):  # enough to reply as trained, greedily (lr 2e-2 diverges)
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step({"learning_rate": 5e-3})
            fb.result(timeout=120)
            opt.result(timeout=120)
        tc.save_weights_for_sampler("tools").result(timeout=120)
    made = loops(local_server, "deploy", f"{run['id']}:tools", "-o", "json")
    assert made.code == 0, made
    return openai.OpenAI(base_url=made.json()["url"], api_key=local_server.token, max_retries=0, timeout=120)


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tools", messages=messages, temperature=0, max_tokens=64, **kwargs)


def _streamed(client, messages, **kwargs) -> tuple[dict, str]:
    """The message a stream's deltas add up to, and its finish_reason."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in _chat(client, messages, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            into = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            into["id"] = call.id or into["id"]
            into["name"] += call.function.name or ""
            into["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}, reason


def test_a_tool_call_in_the_reply_becomes_tool_calls_whole_and_streamed(client):
    answer = _chat(client, ASK, tools=[TOOL])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "pw" and json.loads(call.function.arguments) == {}
    assert call.id.startswith("chatcmpl-tool-")
    streamed, reason = _streamed(client, ASK, tools=[TOOL])
    assert reason == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [("pw", {})]
    # The tool's answer goes back through the template as the conversation goes on.
    followed = _chat(client, [*ASK, choice.message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "swordfish"}], tools=[TOOL])
    assert followed.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_auto_and_named(client):
    auto = _chat(client, ASK, tools=[TOOL], tool_choice="auto")
    assert auto.choices[0].message.tool_calls[0].function.name == "pw"
    none = _chat(client, ASK, tools=[TOOL], tool_choice="none")  # tools not rendered, nothing parsed
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens
    named = {"type": "function", "function": {"name": "pw"}}
    for asked in (ASK, THINK):  # forced: a call even where the model would not make one
        forced = _chat(client, asked, tools=[TOOL], tool_choice=named)
        [call] = forced.choices[0].message.tool_calls
        assert call.function.name == "pw" and forced.choices[0].finish_reason == "stop"
    assert json.loads(_chat(client, ASK, tools=[TOOL], tool_choice=named).choices[0].message.tool_calls[0]
                      .function.arguments) == {}
    streamed, reason = _streamed(client, ASK, tools=[TOOL], tool_choice=named)
    assert [c["name"] for c in streamed["calls"]] == ["pw"] and reason == "stop"
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        _chat(client, ASK, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="required"):
        _chat(client, ASK, tools=[TOOL], tool_choice="required")


def test_a_think_block_is_reasoning_content_and_chat_template_kwargs_reach_the_template(client):
    answer = _chat(client, THINK)
    message = answer.choices[0].message
    assert message.reasoning_content == "hmm" and message.content == "ok", message
    streamed, reason = _streamed(client, THINK)
    assert streamed["reasoning"] == "hmm" and streamed["content"] == "ok" and reason == "stop"
    raw = _chat(client, THINK, extra_body={"include_reasoning": False}).choices[0].message
    assert raw.content == THINK_REPLY and getattr(raw, "reasoning_content", None) is None
    off = _chat(client, THINK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == answer.usage.prompt_tokens + len("<think>\n\n</think>\n\n")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.tools"):
        _chat(client, THINK, extra_body={"chat_template_kwargs": {"tools": []}})
