"""The OpenAI answers of a deployment, apart from the routes (``deployments.py``): usage,
logprobs in the chat and completions shapes (:class:`Vocab`), and a chat reply's tool calls
and reasoning (:class:`ReplyParser`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from baseten_loops_cli.local.engine.sample_types import SampledSequence


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Vocab:
    """Token texts for logprobs (cached: the same ids come back in every top-k list)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.tokenizer.decode([token])
        return text

    def chat_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        """One ``choices[].logprobs.content[]`` item."""
        return {"token": self.text(token), "logprob": logprob,
                "bytes": list(self.text(token).encode()),
                "top_logprobs": [{"token": self.text(t), "logprob": lp,
                                  "bytes": list(self.text(t).encode())} for t, lp in top]}

    def completion_logprobs(self, tokens: list[int], logprobs: list[float | None],
                            tops: list[list[tuple[int, float]] | None], offset: int) -> dict:
        """A completions ``logprobs`` object; ``offset``: where ``tokens``' text starts. A
        None logprob / top (an echoed prompt's first token) stays null."""
        texts = [self.text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": logprobs,
                "top_logprobs": [None if top is None else {self.text(t): lp for t, lp in top}
                                 for top in tops],
                "text_offset": offsets}


def top_lists(seq: SampledSequence) -> list[list[tuple[int, float]]]:
    return list(seq.top_logprobs or [[] for _ in seq.tokens])




# ── tool calls and reasoning in a chat reply (vLLM's hermes tool parser, qwen3 reasoning) ──

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"


def forced_call_prefix(name: str) -> str:
    """The start of a Hermes tool call to ``name``, put after the generation prompt for a named
    ``tool_choice``: the model writes the arguments (vLLM forces them with guided decoding)."""
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": '


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


class ReplyParser:
    """A chat reply's text, pushed as it is generated, split into what OpenAI's message has:
    ``reasoning_content`` (a leading ``<think>...</think>`` block, with ``reasoning``),
    ``content``, and ``tool_calls`` (each ``<tool_call>{"name": ..., "arguments": ...}
    </tool_call>`` whose body is JSON, with ``tools``). As vLLM's parsers do: the content is
    the text before the first tool call (text after one is dropped), a block that is not JSON
    stays content, an unterminated last block is read to the end of the reply, and a think
    block never closed is all reasoning. :meth:`push` returns the deltas ready to send (text
    that could be the start of a tag is held back), :meth:`finish` the rest; both whole and
    streamed answers are built from them, so they agree."""

    def __init__(self, *, tools: bool, reasoning: bool, forced: str | None = None) -> None:
        """``forced``: a named tool_choice; the reply continues :func:`forced_call_prefix`
        (pushed here first), and arguments that are not JSON still make that call, raw."""
        self.tools = tools or forced is not None
        self.state = "start" if reasoning and forced is None else "content"
        self.pending = ""
        self.calls: list[dict] = []
        self.forced = forced
        if forced is not None:
            self.push(forced_call_prefix(forced))

    def push(self, text: str) -> list[dict]:
        self.pending += text
        out: list[dict] = []
        while True:
            before = (self.state, self.pending)
            if self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(THINK_START):
                    self.state, self.pending = "think", stripped[len(THINK_START):]
                elif not (THINK_START.startswith(stripped)):
                    self.state = "content"
                else:
                    break  # still maybe "<think>"
            elif self.state == "think":
                end = self.pending.find(THINK_END)
                if end >= 0:
                    self._emit(out, "reasoning_content", self.pending[:end])
                    self.state, self.pending = "content", self.pending[end + len(THINK_END):]
                else:
                    keep = _held(self.pending, THINK_END)
                    self._emit(out, "reasoning_content", self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
            elif self.state == "content":
                start = self.pending.find(TOOL_CALL_START) if self.tools else -1
                if start >= 0:
                    self._emit(out, "content", self.pending[:start])
                    self.state, self.pending = "call", self.pending[start + len(TOOL_CALL_START):]
                else:
                    keep = _held(self.pending, TOOL_CALL_START) if self.tools else 0
                    self._emit(out, "content", self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
            else:  # "call": inside <tool_call>
                end = self.pending.find(TOOL_CALL_END)
                if end < 0:
                    break
                self._call(out, self.pending[:end])
                self.state, self.pending = "content", self.pending[end + len(TOOL_CALL_END):]
            if (self.state, self.pending) == before:
                break
        return out

    def finish(self) -> list[dict]:
        out: list[dict] = []
        rest, self.pending = self.pending, ""
        if self.state == "think":
            self._emit(out, "reasoning_content", rest)
        elif self.state == "call":
            self._call(out, rest)
        else:
            self._emit(out, "content", rest)
        return out

    def _emit(self, out: list[dict], key: str, text: str) -> None:
        if text and not (key == "content" and self.calls):  # vLLM: no content after a call
            out.append({key: text})

    def _call(self, out: list[dict], body: str) -> None:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            if self.forced is None or self.calls:
                self._emit(out, "content", f"{TOOL_CALL_START}{body}{TOOL_CALL_END}")
                return
            generated = body[len(forced_call_prefix(self.forced)) - len(TOOL_CALL_START):]
            call = {"name": self.forced, "arguments": generated.strip().removesuffix("}")}
        arguments = call.get("arguments", call.get("parameters", {}))
        entry = {"index": len(self.calls), "id": new_tool_call_id(), "type": "function",
                 "function": {"name": call["name"],
                              "arguments": arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)}}
        self.calls.append(entry)
        out.append({"tool_calls": [entry]})


def merged_delta(deltas: list[dict]) -> dict[str, Any]:
    """One streamed ``delta`` carrying ``deltas`` (text joined, tool calls listed)."""
    merged: dict[str, Any] = {}
    for delta in deltas:
        for key, value in delta.items():
            merged[key] = merged.get(key, [] if key == "tool_calls" else "") + value
    return merged


def message_of(deltas: list[dict]) -> dict[str, Any]:
    """A whole chat message from a reply's deltas (:class:`ReplyParser`): content (None when
    the reply is only tool calls), reasoning_content when there is some, tool_calls."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"}
             for d in deltas for c in d.get("tool_calls", [])]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message
