"""Reading the OpenAI requests of a deployment (``deployments.py`` serves the routes): the
body (capped, decoded off the event loop), OpenAI's error object naming the field at fault,
the sampling fields, the parameters implemented and those accepted at their neutral value,
chat messages and tools rendered through the model's chat template (with
``chat_template_kwargs``), and completion prompts in every form OpenAI takes."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request

from baseten_loops_cli.local.engine.sample_types import SampleRequest
from baseten_loops_cli.local.server.compute import ModelSpec
from baseten_loops_cli.local.server.errors import ApiError, openai_error
from baseten_loops_cli.local.server.sampler_routes import (
    DEFAULT_MAX_TOKENS,
    float_field,
    int_field,
    top_p_field,
)
from baseten_loops_cli.local.server.samplers import Adapter
from baseten_loops_cli.local.server.validation import check_token_ids

MAX_N = 16
MAX_TOP_LOGPROBS = 20  # as vLLM (OpenAI allows 20 on chat, 5 on completions)
MAX_PROMPTS = 1024  # prompts in one completions batch
ROLES = ("system", "developer", "user", "assistant", "tool")
# What each role's message may carry (a key set to null counts as absent, as OpenAI's).
_MESSAGE_KEYS = {
    "system": {"role", "content", "name"}, "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal"},
    "tool": {"role", "content", "tool_call_id"},
}


# ── errors in OpenAI's shape ──


def bad(message: str, param: str | None, error_class: str = "InvalidRequest",
         status: int = 400) -> ApiError:
    """A 4xx whose OpenAI error object names ``param`` (the request field at fault)."""
    error = ApiError(status, message, error_class)
    error.extra["error"] = openai_error(error, param)
    return error


def flag_field(body: dict, key: str) -> bool | None:
    """``body[key]`` when it is true or false, None when absent or null; else a 400 naming it."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{key} must be true or false, got {value!r}.", key)
    return value


def named_field(param: str, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``read(*args, **kwargs)`` (a sampler_routes field reader), its 400 naming ``param``."""
    try:
        return read(*args, **kwargs)
    except ApiError as error:
        error.extra.setdefault("error", openai_error(error, param))
        raise


# ── the request body: capped, decoded off the event loop ──


async def read_body(request: Request, cap: int) -> dict:
    """The JSON object of the body. Past ``cap`` bytes: 413 before reading the rest (by
    Content-Length, or as the bytes come), with ``Connection: close`` since the unread rest
    makes the connection unusable."""
    def too_large() -> ApiError:
        error = bad(f"The request body is over this server's limit of {cap} bytes "
                     "(max_openai_body_bytes). Send fewer or shorter prompts.", None,
                     "RequestTooLarge", status=413)
        error.headers["Connection"] = "close"
        return error

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise too_large()
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > cap:
            raise too_large()
        parts.append(part)
    return await asyncio.to_thread(_decode_json, b"".join(parts))


def _decode_json(raw: bytes) -> dict:
    if not raw.strip():
        raise bad("This route needs a JSON body (an object).", None, "InvalidJson")
    try:
        payload = json.loads(raw)
    except RecursionError:
        raise bad("The request body is JSON nested too deeply to read.", None,
                   "InvalidJson") from None
    except ValueError as exc:
        raise bad(f"Request body is not valid JSON: {exc}.", None, "InvalidJson") from None
    if not isinstance(payload, dict):
        raise bad("Request body must be a JSON object.", None, "InvalidJson")
    where = _lone_surrogate(payload)
    if where is not None:
        raise bad(f"{where} holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                   "text: send valid Unicode.", where, "InvalidText")
    return payload


def _lone_surrogate(payload: dict) -> str | None:
    """The path of the first string (or key) that cannot be UTF-8 encoded, else None."""
    stack: list[tuple[str, Any]] = [("", payload)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                sub = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    return sub
                if isinstance(item, (str, dict, list)):
                    stack.append((sub, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))
        elif not _is_text(value):
            return path
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

# ── sampling parameters ──


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of a request, checked once for all of its prompts."""

    max_tokens: int | None  # None: the default (16, or what room is left)
    n: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]


def read_sampling(body: dict, *, scoring: bool) -> Sampling:
    """``scoring``: echo is on, so ``max_tokens: 0`` (score the prompt only) is allowed."""
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):
        value = named_field(key, int_field, body, key, None, minimum=0)
        if value == 0 and not scoring:
            raise bad(f"{key} must be >= 1 (0 is allowed with echo: true, which scores the "
                       "prompt only).", key)
        if value is not None:
            max_tokens = value
            break
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise bad("stop must be a string or a list of strings.", "stop")
    top_k = named_field("top_k", int_field, body, "top_k", -1)
    if top_k is not None and top_k < -1:
        raise bad(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}.", "top_k")
    return Sampling(
        max_tokens=max_tokens,
        n=named_field("n", int_field, body, "n", 1, minimum=1, maximum=MAX_N) or 1,
        temperature=named_field("temperature", float_field, body, "temperature", 1.0, 0.0, 2.0),
        top_p=named_field("top_p", top_p_field, body),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=named_field("seed", int_field, body, "seed", None),
        stop=list(stop or []))


def sample_job(sampling: Sampling, prompt: list[int], max_len: int, stop_ids: list[int],
         adapter: Adapter | None, param: str) -> SampleRequest:
    room = max_len - len(prompt)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        if room < 1:
            raise bad(f"{param} is {len(prompt)} tokens, leaving no room under the maximum "
                       f"length {max_len}.", param, "SequenceTooLong")
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    elif max_tokens > room:
        raise bad(f"{param} ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                   f"maximum length {max_len}; use max_tokens <= {max(room, 0)}.", param,
                   "SequenceTooLong")
    return SampleRequest(
        prompt=prompt, n=sampling.n, max_tokens=max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
        stop_token_ids=stop_ids, stop=sampling.stop, prompt_logprobs=None,
        adapter=adapter.key if adapter else None, adapter_path=adapter.path if adapter else None,
        adapter_family=adapter.family if adapter else None)


def reject_unsupported(body: dict, implemented: frozenset[str]) -> None:
    """400 for the first parameter that would change the answer but is not implemented."""
    for key, value in body.items():
        if key in implemented or value is None or value in NEUTRAL.get(key, ()):
            continue
        error = bad(
            f"Unsupported parameter {key!r}: this deployment does not implement it. Remove it "
            f"(implemented: {', '.join(sorted(implemented))}).", key, "UnsupportedParameter")
        error.extra["error"]["message"] = (f"Unsupported parameter: '{key}' (this deployment "
                                           "does not implement it).")
        raise error
    if body.get("stream_options") is not None and not body.get("stream"):
        raise bad("stream_options is only allowed with stream: true.", "stream_options")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise bad("stream_options takes only include_usage (true or false).", "stream_options")
    if not isinstance(body.get("stream", False), bool):
        raise bad(f"stream must be true or false, got {body['stream']!r}.", "stream")


def include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


CHAT_PARAMS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
    "temperature", "top_p", "top_k", "logprobs", "top_logprobs", "stream", "stream_options",
    "user", "tools", "tool_choice", "chat_template_kwargs", "include_reasoning"})
COMPLETION_PARAMS = frozenset({
    "model", "prompt", "max_tokens", "n", "stop", "seed", "temperature", "top_p", "top_k",
    "logprobs", "echo", "stream", "stream_options", "user"})
# Parameters accepted only at the value that changes nothing (clients often send these).
NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "functions": ([],),
    "response_format": ({"type": "text"},), "best_of": (1,),
    "suffix": ("",), "store": (False,), "modalities": (["text"],), "metadata": ({},),
    "parallel_tool_calls": (False, True), "service_tier": ("auto", "default"),
}

# ── chat ──


def _text_content(content: Any, where: str, *, may_be_null: bool) -> str | None:
    """A message's content as one string: a string, or a list of text parts joined."""
    if content is None and may_be_null:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}] is a {kind or type(part).__name__!r} part; "
                           "this model takes text parts only ({\"type\": \"text\", \"text\": "
                           "...}).", f"{where}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content must be a string or a list of text parts, got "
               f"{type(content).__name__}.", f"{where}.content")


def _tool_calls(calls: Any, where: str, seen: set[str]) -> list[dict]:
    """OpenAI tool calls as chat templates take them (arguments decoded to an object, as
    transformers and vLLM pass them); their ids go to ``seen``."""
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where}.tool_calls must be a non-empty list.", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or call.get("type", "function") != "function"
                or not isinstance(call.get("id"), str) or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)):
            raise bad(f"{at} must be {{\"id\": str, \"type\": \"function\", \"function\": "
                       "{\"name\": str, \"arguments\": a JSON string}}.", at)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise bad(f"{at}.function.arguments is not JSON.",
                       f"{at}.function.arguments") from None
        seen.add(call["id"])
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def read_messages(raw: Any, tools_ok: bool) -> list[dict]:
    """``messages`` checked and normalized for the chat template (see the module docstring)."""
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list of message objects.", "messages")
    out: list[dict] = []
    call_ids: set[str] = set()
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object with a role and content.", where)
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role {role!r} is not one of {', '.join(ROLES)}.",
                       f"{where}.role", "InvalidRole")
        extra = sorted(k for k, v in message.items() if v is not None
                       and k not in _MESSAGE_KEYS[role])
        if extra:
            raise bad(f"{where} has {extra[0]!r}, which a {role} message does not take "
                       f"(it takes {', '.join(sorted(_MESSAGE_KEYS[role]))}).",
                       f"{where}.{extra[0]}")
        calls = message.get("tool_calls")
        content = _text_content(message.get("content"), where,
                                may_be_null=role == "assistant" and calls is not None)
        normal: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                  "content": content}
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise bad(f"{where}.name must be a string.", f"{where}.name")
            normal["name"] = message["name"]
        if calls is not None:
            if not tools_ok:
                raise bad(f"{where}.tool_calls: this model's chat template has no tools, so "
                           "tool calls cannot be rendered.", f"{where}.tool_calls",
                           "ToolsUnsupported")
            normal["tool_calls"] = _tool_calls(calls, where, call_ids)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where} (a tool message) needs tool_call_id: the id of the "
                           "assistant tool call it answers.", f"{where}.tool_call_id")
            if call_id not in call_ids:
                raise bad(f"{where}.tool_call_id {call_id!r} answers no earlier assistant "
                           "tool call.", f"{where}.tool_call_id")
            normal["tool_call_id"] = call_id
        out.append(normal)
    return out


@dataclass(frozen=True)
class ChatOptions:
    """What a chat request asks of the template and of the reply's parsing."""

    tools: list[dict] | None  # the function definitions the template renders (None: none)
    parse_tool_calls: bool  # tool_choice auto/named with tools: <tool_call> blocks are calls
    forced: str | None  # a named tool_choice: the function the reply calls
    reasoning: bool  # a leading <think> block is reasoning_content
    template_kwargs: dict[str, Any]  # chat_template_kwargs, e.g. {"enable_thinking": false}


_RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "documents")


def read_chat_options(body: dict, tokenizer: Any) -> ChatOptions:
    """``tools``, ``tool_choice`` (none / auto / a named function, as vLLM takes them),
    ``chat_template_kwargs`` and ``include_reasoning`` (vLLM's: default on where the chat
    template writes ``<think>``, a reasoning model)."""
    from baseten_loops_cli.tokenization import template_supports_tools

    tools, choice = body.get("tools"), body.get("tool_choice")
    forced = None
    if isinstance(choice, dict):
        function = choice.get("function")
        if (choice.get("type") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)):
            raise bad("tool_choice must be 'none', 'auto' or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}.", "tool_choice")
        forced = function["name"]
    elif choice not in (None, "auto", "none"):
        raise bad(f"tool_choice {choice!r} is not implemented here (this deployment cannot force "
                  "a call without its name): use 'none', 'auto' or a named function "
                  "({\"type\": \"function\", \"function\": {\"name\": ...}}).", "tool_choice")
    if tools == []:
        tools = None
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise bad("tools must be a list of {\"type\": \"function\", \"function\": {\"name\": "
                  "..., \"parameters\": {...}}}.", "tools")
    if tools is not None and not template_supports_tools(tokenizer):
        raise bad("tools: this model's chat template has no tools (it cannot render tool "
                  "definitions). Remove tools, or serve a model whose template has them.",
                  "tools", "ToolsUnsupported")
    if forced is not None and forced not in [t["function"]["name"] for t in tools or []]:
        raise bad(f"tool_choice names the function {forced!r}, which is not in tools.",
                  "tool_choice")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs must be an object of template variables, e.g. "
                  "{\"enable_thinking\": false}.", "chat_template_kwargs")
    taken = next((k for k in kwargs if k in _RENDER_VARIABLES), None)
    if taken is not None:
        raise bad(f"chat_template_kwargs.{taken} is set by the request itself; remove it.",
                  f"chat_template_kwargs.{taken}")
    reasoning = flag_field(body, "include_reasoning")
    if reasoning is None:
        reasoning = "<think>" in (getattr(tokenizer, "chat_template", None) or "")
    rendered = None if choice == "none" else tools
    return ChatOptions(tools=rendered, parse_tool_calls=rendered is not None, forced=forced,
                       reasoning=reasoning, template_kwargs=dict(kwargs))


def render_chat_prompt(tokenizer: Any, raw_messages: Any, body: dict) -> list[int]:
    """The prompt tokens of a chat request (on a worker thread); with a named
    ``tool_choice``, the start of that call follows the generation prompt."""
    from baseten_loops_cli.local.server.openai_replies import forced_call_prefix
    from baseten_loops_cli.tokenization import (
        render_generation_prompt,
        template_supports_tools,
    )

    options = read_chat_options(body, tokenizer)
    messages = read_messages(raw_messages, template_supports_tools(tokenizer))
    try:
        import jinja2

        render_errors: tuple[type[BaseException], ...] = (ValueError, TypeError, jinja2.TemplateError)
    except ImportError:
        render_errors = (ValueError, TypeError)
    try:
        prompt = list(render_generation_prompt(tokenizer, messages, options.tools,
                                               options.template_kwargs))
    except render_errors as exc:
        raise bad(f"The model's chat template cannot render these messages: {exc}",
                  "messages", "TemplateError") from None
    if options.forced is not None:
        prompt += tokenizer.encode(forced_call_prefix(options.forced))
    return prompt


# ── completions ──


def read_prompts(raw: Any, tokenizer: Any, spec: ModelSpec) -> list[tuple[list[int], str | None]]:
    """Each prompt of ``prompt`` in every form OpenAI takes (a string, strings, token ids,
    token-id lists) as (token ids, its text if given as text); on a worker thread."""
    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(is_id(x) for x in raw):
        items = [raw]
    elif isinstance(raw, list) and raw and (all(isinstance(x, str) for x in raw)
                                            or all(isinstance(x, list) for x in raw)):
        items = raw
    else:
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list "
                   "of token-id lists (not empty).", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad(f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS} per request.",
                   "prompt")
    out = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        ids = list(tokenizer.encode(item)) if isinstance(item, str) else item
        if not ids:
            raise bad(f"{param} is empty.", param)
        named_field(param, check_token_ids, ids, spec, param)
        out.append((ids, item if isinstance(item, str) else None))
    return out


