"""OpenAI-compatible serving of deployed checkpoints: ``/deployments/<id>/v1/...``.

``POST /v1/loops/checkpoints/deploy`` creates an inference deployment from sampler
checkpoints; this module serves it like a vLLM deployment would:

    GET  /deployments/<id>/v1/models
    POST /deployments/<id>/v1/chat/completions   messages -> chat template -> generate
    POST /deployments/<id>/v1/completions        text or token ids (or a batch) -> generate

``model`` selects a deployed checkpoint by its name (as on Baseten: "set the model
parameter to the Loops checkpoint name"), the deployment's model name (``loops deploy
--model-name``: its first checkpoint), or the base model by its name.

- ``logprobs`` (chat: ``logprobs: true`` + ``top_logprobs: k``; completions: ``logprobs: k``)
  come in OpenAI's shapes, from the sampler's own logprobs (the unmodified distribution the
  trainer agrees with). They cover every generated token, a final stop token (end of turn)
  included, as OpenAI and vLLM list it (its text, e.g. ``<|im_end|>``, is not in the
  returned text): harnesses that drop the last logprob of ``echo`` + ``max_tokens: 1`` as
  the generated token rely on it (issue 43).
- ``echo: true`` on completions returns the prompt before the completion and, with
  ``logprobs``, the prompt's tokens and logprobs first (the first token's is ``null``, as
  OpenAI's): the sampler's prompt logprobs, the numbers the trainer's ``forward`` gives.
  ``max_tokens: 0`` (with echo) only scores the prompt: how evaluation harnesses score
  loglikelihood and multiple-choice tasks.
- ``prompt`` takes every form OpenAI's does: a string, a list of strings, a list of token
  ids, or a list of token-id lists. Each prompt gets ``n`` choices, numbered ``i * n + j``.
- ``messages``: roles system, developer (rendered as system), user, assistant (with
  ``tool_calls``) and tool (with ``tool_call_id``); content a string or a list of text parts.
  ``tools`` and tool calls go through the model's chat template when it renders them; a
  template without tools is a 400 saying so. The reply is text (no tool-call parsing).
- ``stream: true`` answers server-sent events token by token as the sampler decodes (the
  engine hands each token over between decode steps): per choice the role delta first,
  then each token's text with its logprobs, then a chunk with ``finish_reason`` (and no
  logprobs); ``stream_options.include_usage`` adds the usage chunk before ``[DONE]``.
- A parameter this endpoint does not implement is a 400 naming it (unless it has its
  neutral value, e.g. ``presence_penalty: 0``), never silently ignored.
- Every error carries OpenAI's error object (``error: {message, type, param, code}``) beside
  the server's ``detail``/``error_class``; an unexpected failure is a 500 of the same shape
  answered here (the connection stays usable). The body is read up to
  ``ServerConfig.max_openai_body_bytes`` (413 with ``Connection: close`` past it, without
  reading the rest) and decoded, tokenized and rendered off the event loop, so a huge prompt
  never holds up other requests (``/health`` included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local.engine.sample_types import (
    SampledSequence,
    SampleRequest,
    SampleResult,
)
from baseten_loops_cli.local.server.compute import ModelSpec
from baseten_loops_cli.local.server.context import ServerContext, get_ctx
from baseten_loops_cli.local.server.deployment_registry import DeploymentRow
from baseten_loops_cli.local.server.errors import ApiError, bad_request, choices, openai_error
from baseten_loops_cli.local.server.sampler_routes import (
    DEFAULT_MAX_TOKENS,
    float_field,
    int_field,
    top_p_field,
)
from baseten_loops_cli.local.server.samplers import Adapter
from baseten_loops_cli.local.server.streaming import sse_batch_response
from baseten_loops_cli.local.server.validation import check_token_ids

log = logging.getLogger("loops.server.deployments")

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


def _bad(message: str, param: str | None, error_class: str = "InvalidRequest",
         status: int = 400) -> ApiError:
    """A 4xx whose OpenAI error object names ``param`` (the request field at fault)."""
    error = ApiError(status, message, error_class)
    error.extra["error"] = openai_error(error, param)
    return error


def _field(param: str, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``read(*args, **kwargs)`` (a sampler_routes field reader), its 400 naming ``param``."""
    try:
        return read(*args, **kwargs)
    except ApiError as error:
        error.extra.setdefault("error", openai_error(error, param))
        raise


# ── the request body: capped, decoded off the event loop ──


async def _read_body(request: Request, cap: int) -> dict:
    """The JSON object of the body. Past ``cap`` bytes: 413 before reading the rest (by
    Content-Length, or as the bytes come), with ``Connection: close`` since the unread rest
    makes the connection unusable."""
    def too_large() -> ApiError:
        error = _bad(f"The request body is over this server's limit of {cap} bytes "
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
        raise _bad("This route needs a JSON body (an object).", None, "InvalidJson")
    try:
        payload = json.loads(raw)
    except RecursionError:
        raise _bad("The request body is JSON nested too deeply to read.", None,
                   "InvalidJson") from None
    except ValueError as exc:
        raise _bad(f"Request body is not valid JSON: {exc}.", None, "InvalidJson") from None
    if not isinstance(payload, dict):
        raise _bad("Request body must be a JSON object.", None, "InvalidJson")
    where = _lone_surrogate(payload)
    if where is not None:
        raise _bad(f"{where} holds a lone UTF-16 surrogate (such as \\ud800), which is not "
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


async def _off_loop(ctx: ServerContext, dep: DeploymentRow, work: Callable[..., Any],
                    *args: Any) -> Any:
    """``work(*args)`` (tokenizing, rendering) on a worker thread. Test hook: a job fault
    on ``tokenize <deployment id>`` holds it there (``/health`` must still answer)."""
    hold = ctx.pool.before_job

    def run() -> Any:
        if hold is not None:
            hold(f"tokenize {dep.id}")
        return work(*args)

    return await asyncio.to_thread(run)


# ── deployment, model, tokenizer ──


def _deployment(ctx: ServerContext, deployment_id: str) -> DeploymentRow:
    return ctx.deployments.serving(deployment_id)


def _adapters(ctx: ServerContext, dep: DeploymentRow) -> dict[str, Adapter]:
    return ctx.deployments.adapters(dep)


def _model_ids(dep: DeploymentRow, adapters: dict[str, Adapter]) -> list[str]:
    """What ``model`` may name: the deployment's model name (its first checkpoint), each
    checkpoint by name, the base model."""
    ids = [dep.name] if dep.name and adapters and dep.name not in adapters else []
    return [*ids, *adapters, dep.base_model]


def _select(ctx: ServerContext, dep: DeploymentRow, model: Any) -> tuple[Adapter | None, str]:
    adapters = _adapters(ctx, dep)
    if model is None:
        if len(adapters) == 1:
            name, adapter = next(iter(adapters.items()))
            return adapter, name
        raise _bad(f"Pass model: one of {choices(_model_ids(dep, adapters))}.", "model",
                   "ModelRequired")
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {model!r}.", "model")
    if model in adapters:
        return adapters[model], model
    if model == dep.base_model:
        return None, model
    if model == dep.name and adapters:
        return next(iter(adapters.values())), model
    raise _bad(f"The model {model!r} does not exist on deployment {dep.id}. Available: "
               f"{choices(_model_ids(dep, adapters))}.", "model", "ModelNotFound", status=404)


async def _tokenizer(base_model: str):
    from baseten_loops_cli.tokenization import get_tokenizer

    return await asyncio.to_thread(get_tokenizer, base_model)


def _stop_ids(tokenizer: Any) -> list[int]:
    """Generation ends at the end of a turn or of the text, as a served model would."""
    stops = list(getattr(tokenizer, "stop_token_ids", ()) or ())
    if not stops and tokenizer.eos_token_id is not None:
        stops = [tokenizer.eos_token_id]
    return stops


# ── sampling parameters ──


@dataclass(frozen=True)
class _Sampling:
    """The sampling fields of a request, checked once for all of its prompts."""

    max_tokens: int | None  # None: the default (16, or what room is left)
    n: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]


def _sampling(body: dict, *, scoring: bool) -> _Sampling:
    """``scoring``: echo is on, so ``max_tokens: 0`` (score the prompt only) is allowed."""
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):
        value = _field(key, int_field, body, key, None, minimum=0)
        if value == 0 and not scoring:
            raise _bad(f"{key} must be >= 1 (0 is allowed with echo: true, which scores the "
                       "prompt only).", key)
        if value is not None:
            max_tokens = value
            break
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise _bad("stop must be a string or a list of strings.", "stop")
    top_k = _field("top_k", int_field, body, "top_k", -1)
    if top_k is not None and top_k < -1:
        raise _bad(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}.", "top_k")
    return _Sampling(
        max_tokens=max_tokens,
        n=_field("n", int_field, body, "n", 1, minimum=1, maximum=MAX_N) or 1,
        temperature=_field("temperature", float_field, body, "temperature", 1.0, 0.0, 2.0),
        top_p=_field("top_p", top_p_field, body),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=_field("seed", int_field, body, "seed", None),
        stop=list(stop or []))


def _job(sampling: _Sampling, prompt: list[int], max_len: int, stop_ids: list[int],
         adapter: Adapter | None, param: str) -> SampleRequest:
    room = max_len - len(prompt)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        if room < 1:
            raise _bad(f"{param} is {len(prompt)} tokens, leaving no room under the maximum "
                       f"length {max_len}.", param, "SequenceTooLong")
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    elif max_tokens > room:
        raise _bad(f"{param} ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                   f"maximum length {max_len}; use max_tokens <= {max(room, 0)}.", param,
                   "SequenceTooLong")
    return SampleRequest(
        prompt=prompt, n=sampling.n, max_tokens=max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
        stop_token_ids=stop_ids, stop=sampling.stop, prompt_logprobs=None,
        adapter=adapter.key if adapter else None, adapter_path=adapter.path if adapter else None)


def _reject_unsupported(body: dict, implemented: frozenset[str]) -> None:
    """400 for the first parameter that would change the answer but is not implemented."""
    for key, value in body.items():
        if key in implemented or value is None or value in _NEUTRAL.get(key, ()):
            continue
        error = _bad(
            f"Unsupported parameter {key!r}: this deployment does not implement it. Remove it "
            f"(implemented: {', '.join(sorted(implemented))}).", key, "UnsupportedParameter")
        error.extra["error"]["message"] = (f"Unsupported parameter: '{key}' (this deployment "
                                           "does not implement it).")
        raise error
    if body.get("stream_options") is not None and not body.get("stream"):
        raise _bad("stream_options is only allowed with stream: true.", "stream_options")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise _bad("stream_options takes only include_usage (true or false).", "stream_options")
    if not isinstance(body.get("stream", False), bool):
        raise _bad(f"stream must be true or false, got {body['stream']!r}.", "stream")


def _include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Vocab:
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


def _tops(seq: SampledSequence) -> list[list[tuple[int, float]]]:
    return list(seq.top_logprobs or [[] for _ in seq.tokens])


async def _prepare(ctx: ServerContext, request: Request, implemented: frozenset[str]
                   ) -> tuple[DeploymentRow, dict, Adapter | None, str, Any, ModelSpec]:
    body = await _read_body(request, ctx.config.max_openai_body_bytes)
    dep = _deployment(ctx, request.path_params["deployment_id"])
    _reject_unsupported(body, implemented)
    adapter, model = _select(ctx, dep, body.get("model"))
    tokenizer = await _tokenizer(dep.base_model)
    return dep, body, adapter, model, tokenizer, await ctx.models.spec(dep.base_model)


def _record_usage(ctx: ServerContext, dep: DeploymentRow, outs: list[SampleResult], model: str) -> int:
    """Count one request's answers for the deployment and (through the checkpoint that served
    them) for the run it came from."""
    completion_tokens = sum(len(s.tokens) for out in outs for s in out.sequences)
    adapter = _adapters(ctx, dep).get(model)
    ctx.deployments.record_usage(dep, completion_tokens,
                                 checkpoint_pk=adapter.checkpoint_pk if adapter else None)
    return completion_tokens


_CHAT_PARAMS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
    "temperature", "top_p", "top_k", "logprobs", "top_logprobs", "stream", "stream_options",
    "user", "tools", "tool_choice"})
_COMPLETION_PARAMS = frozenset({
    "model", "prompt", "max_tokens", "n", "stop", "seed", "temperature", "top_p", "top_k",
    "logprobs", "echo", "stream", "stream_options", "user"})
# Parameters accepted only at the value that changes nothing (clients often send these).
_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "functions": ([],),
    "response_format": ({"type": "text"},), "best_of": (1,),
    "suffix": ("",), "store": (False,), "modalities": (["text"],), "metadata": ({},),
    "parallel_tool_calls": (False, True), "service_tier": ("auto", "default"),
}


async def _answer(ctx: ServerContext, dep: DeploymentRow, body: dict,
                  jobs: list[SampleRequest], tokenizer: Any, model: str, *, id_prefix: str,
                  objects: tuple[str, str],
                  streamed_choice: Callable[[int, str, Any], dict | None],
                  whole_choice: Callable[[int, int, SampledSequence, SampleResult], dict]
                  ) -> Response:
    """What both OpenAI routes do once the jobs (one per prompt) are built: stream them as
    server-sent events (``streamed_choice(index, kind, payload)``, kinds as
    streaming.ChunkBuilder's but for "usage", builds a chunk's one choice, or None: nothing
    to send) or generate them whole (``whole_choice(index, job, sequence, output)``), and
    record the usage. Choice ``index`` = job * n + sample, as OpenAI numbers a batch's.
    ``objects``: the answer's ``object`` when whole and when streamed."""
    whole, streamed = objects
    created, ident = int(time.time()), f"{id_prefix}-{uuid.uuid4().hex}"
    head = {"id": ident, "object": streamed, "created": created, "model": model}
    prompt_tokens = sum(len(job.prompt) for job in jobs)

    if body.get("stream"):
        def chunk(index: int | None, kind: str, payload: Any) -> dict | None:
            if kind == "usage":
                return {**head, "choices": [], "usage": payload}
            built = streamed_choice(index, kind, payload)  # type: ignore[arg-type]
            return None if built is None else {**head, "choices": [built]}

        return await sse_batch_response(
            ctx.samplers, dep.base_model, jobs, tokenizer, chunk,
            include_usage=_include_usage(body),
            on_done=lambda outs: _usage(prompt_tokens, _record_usage(ctx, dep, outs, model)))

    outs = list(await asyncio.gather(*(ctx.samplers.generate(dep.base_model, job)
                                       for job in jobs)))
    completion_tokens = _record_usage(ctx, dep, outs, model)
    n = jobs[0].n
    return JSONResponse({**head, "object": whole,
                         "choices": [whole_choice(k * n + j, k, s, out)
                                     for k, out in enumerate(outs)
                                     for j, s in enumerate(out.sequences)],
                         "usage": _usage(prompt_tokens, completion_tokens)})


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
                raise _bad(f"{where}.content[{j}] is a {kind or type(part).__name__!r} part; "
                           "this model takes text parts only ({\"type\": \"text\", \"text\": "
                           "...}).", f"{where}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{where}.content must be a string or a list of text parts, got "
               f"{type(content).__name__}.", f"{where}.content")


def _tool_calls(calls: Any, where: str, seen: set[str]) -> list[dict]:
    """OpenAI tool calls as chat templates take them (arguments decoded to an object, as
    transformers and vLLM pass them); their ids go to ``seen``."""
    if not isinstance(calls, list) or not calls:
        raise _bad(f"{where}.tool_calls must be a non-empty list.", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or call.get("type", "function") != "function"
                or not isinstance(call.get("id"), str) or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)):
            raise _bad(f"{at} must be {{\"id\": str, \"type\": \"function\", \"function\": "
                       "{\"name\": str, \"arguments\": a JSON string}}.", at)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise _bad(f"{at}.function.arguments is not JSON.",
                       f"{at}.function.arguments") from None
        seen.add(call["id"])
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _messages(raw: Any, tools_ok: bool) -> list[dict]:
    """``messages`` checked and normalized for the chat template (see the module docstring)."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list of message objects.", "messages")
    out: list[dict] = []
    call_ids: set[str] = set()
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object with a role and content.", where)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role {role!r} is not one of {', '.join(ROLES)}.",
                       f"{where}.role", "InvalidRole")
        extra = sorted(k for k, v in message.items() if v is not None
                       and k not in _MESSAGE_KEYS[role])
        if extra:
            raise _bad(f"{where} has {extra[0]!r}, which a {role} message does not take "
                       f"(it takes {', '.join(sorted(_MESSAGE_KEYS[role]))}).",
                       f"{where}.{extra[0]}")
        calls = message.get("tool_calls")
        content = _text_content(message.get("content"), where,
                                may_be_null=role == "assistant" and calls is not None)
        normal: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                  "content": content}
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise _bad(f"{where}.name must be a string.", f"{where}.name")
            normal["name"] = message["name"]
        if calls is not None:
            if not tools_ok:
                raise _bad(f"{where}.tool_calls: this model's chat template has no tools, so "
                           "tool calls cannot be rendered.", f"{where}.tool_calls",
                           "ToolsUnsupported")
            normal["tool_calls"] = _tool_calls(calls, where, call_ids)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{where} (a tool message) needs tool_call_id: the id of the "
                           "assistant tool call it answers.", f"{where}.tool_call_id")
            if call_id not in call_ids:
                raise _bad(f"{where}.tool_call_id {call_id!r} answers no earlier assistant "
                           "tool call.", f"{where}.tool_call_id")
            normal["tool_call_id"] = call_id
        out.append(normal)
    return out


def _tools(body: dict, tools_ok: bool) -> list[dict] | None:
    """The function definitions for the chat template (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad("tool_choice takes 'auto' or 'none' here: this deployment renders tools "
                   "for the model but cannot force a call.", "tool_choice")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise _bad("tools must be a list of {\"type\": \"function\", \"function\": {\"name\": "
                   "..., \"parameters\": {...}}}.", "tools")
    if not tools_ok:
        raise _bad("tools: this model's chat template has no tools (it cannot render tool "
                   "definitions). Remove tools, or serve a model whose template has them.",
                   "tools", "ToolsUnsupported")
    return None if choice == "none" else tools


def _render(tokenizer: Any, raw_messages: Any, body: dict) -> list[int]:
    """The prompt tokens of a chat request (on a worker thread)."""
    from baseten_loops_cli.tokenization import render_generation_prompt, template_supports_tools

    tools_ok = template_supports_tools(tokenizer)
    tools = _tools(body, tools_ok)
    messages = _messages(raw_messages, tools_ok)
    try:
        import jinja2

        template_error: tuple[type[BaseException], ...] = (jinja2.TemplateError,)
    except ImportError:
        template_error = ()
    try:
        return list(render_generation_prompt(tokenizer, messages, tools))
    except (ValueError, TypeError, *template_error) as exc:
        raise _bad(f"The model's chat template cannot render these messages: {exc}",
                   "messages", "TemplateError") from None


async def chat_completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep, body, adapter, model, tokenizer, spec = await _prepare(ctx, request, _CHAT_PARAMS)
    want_logprobs = body.get("logprobs") or False
    if not isinstance(want_logprobs, bool):
        raise _bad(f"logprobs must be true or false, got {want_logprobs!r}.", "logprobs")
    top_k = _field("top_logprobs", int_field, body, "top_logprobs", 0, minimum=0,
                   maximum=MAX_TOP_LOGPROBS) or 0
    if top_k and not want_logprobs:
        raise _bad("top_logprobs needs logprobs: true.", "top_logprobs")
    sampling = _sampling(body, scoring=False)
    prompt = await _off_loop(ctx, dep, _render, tokenizer, body.get("messages"), body)
    stop_ids = _stop_ids(tokenizer)
    job = _job(sampling, prompt, spec.max_seq_len, stop_ids, adapter, "messages")
    job.top_logprobs = top_k
    vocab = _Vocab(tokenizer)

    def streamed_choice(index: int, kind: str, payload: Any) -> dict | None:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
        if kind == "start":
            choice["delta"] = {"role": "assistant", "content": ""}
        elif kind == "token":
            text, event = payload
            if want_logprobs:
                choice["logprobs"] = {"content": [
                    vocab.chat_entry(event.token, event.logprob, event.top)]}
            elif not text:
                return None
            choice["delta"] = {"content": text}
        else:
            text, reason = payload
            choice["delta"] = {"content": text} if text else {}
            choice["finish_reason"] = reason
        return choice

    def whole_choice(index: int, _job_index: int, s: SampledSequence, _out: SampleResult
                     ) -> dict:
        logprobs = {"content": [vocab.chat_entry(t, lp, top) for t, lp, top in zip(
            s.tokens, s.logprobs, _tops(s))]} if want_logprobs else None
        return {"index": index, "message": {"role": "assistant", "content": s.text},
                "finish_reason": s.finish_reason, "logprobs": logprobs}

    return await _answer(ctx, dep, body, [job], tokenizer, model, id_prefix="chatcmpl",
                         objects=("chat.completion", "chat.completion.chunk"),
                         streamed_choice=streamed_choice, whole_choice=whole_choice)


# ── completions ──


def _prompts(raw: Any, tokenizer: Any, spec: ModelSpec) -> list[tuple[list[int], str | None]]:
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
        raise _bad("prompt must be a string, a list of strings, a list of token ids or a list "
                   "of token-id lists (not empty).", "prompt")
    if len(items) > MAX_PROMPTS:
        raise _bad(f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS} per request.",
                   "prompt")
    out = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        ids = list(tokenizer.encode(item)) if isinstance(item, str) else item
        if not ids:
            raise _bad(f"{param} is empty.", param)
        _field(param, check_token_ids, ids, spec, param)
        out.append((ids, item if isinstance(item, str) else None))
    return out


async def completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep, body, adapter, model, tokenizer, spec = await _prepare(ctx, request, _COMPLETION_PARAMS)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise _bad(f"echo must be true or false, got {echo!r}.", "echo")
    want_logprobs = _field("logprobs", int_field, body, "logprobs", None, minimum=0,
                           maximum=MAX_TOP_LOGPROBS)
    if echo and want_logprobs is not None and body.get("stream"):
        raise _bad("echo with logprobs cannot be streamed here (the prompt's logprobs come "
                   "with the whole answer); drop stream.", "echo")
    sampling = _sampling(body, scoring=echo)
    prompts = await _off_loop(ctx, dep, _prompts, body.get("prompt"), tokenizer, spec)
    stop_ids = _stop_ids(tokenizer)
    jobs = []
    for i, (ids, _) in enumerate(prompts):
        job = _job(sampling, ids, spec.max_seq_len, stop_ids, adapter,
                   "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        job.top_logprobs = want_logprobs or 0
        if echo and want_logprobs is not None:
            job.prompt_logprobs = want_logprobs
        jobs.append(job)
    vocab = _Vocab(tokenizer)
    echoed = [(text if text is not None else tokenizer.decode(ids)) if echo else ""
              for ids, text in prompts]
    n = sampling.n
    offsets = [len(echoed[i // n]) for i in range(n * len(jobs))]  # streamed text_offset

    def streamed_choice(index: int, kind: str, payload: Any) -> dict | None:
        choice: dict[str, Any] = {"index": index, "text": "", "logprobs": None,
                                  "finish_reason": None}
        if kind == "start":  # completions chunks have no role delta; echo sends the prompt
            if not echoed[index // n]:
                return None
            choice["text"] = echoed[index // n]
        elif kind == "token":
            text, event = payload
            if want_logprobs is not None:
                choice["logprobs"] = vocab.completion_logprobs(
                    [event.token], [event.logprob], [event.top], offsets[index])
                offsets[index] += len(vocab.text(event.token))
            elif not text:
                return None
            choice["text"] = text
        else:
            choice["text"], choice["finish_reason"] = payload
        return choice

    def whole_choice(index: int, k: int, s: SampledSequence, out: SampleResult) -> dict:
        logprobs = None
        if want_logprobs is not None:
            tokens: list[int] = list(s.tokens)
            values: list[float | None] = list(s.logprobs)
            tops: list[list[tuple[int, float]] | None] = list(_tops(s))
            if echo:
                scored = out.prompt_logprobs or [None] * len(jobs[k].prompt)
                tokens = jobs[k].prompt + tokens
                values = [None if e is None else e.logprob for e in scored] + values
                tops = [None if e is None else e.top for e in scored] + tops
            logprobs = vocab.completion_logprobs(tokens, values, tops, 0)
        return {"index": index, "text": echoed[k] + s.text, "finish_reason": s.finish_reason,
                "logprobs": logprobs}

    return await _answer(ctx, dep, body, jobs, tokenizer, model, id_prefix="cmpl",
                         objects=("text_completion", "text_completion"),
                         streamed_choice=streamed_choice, whole_choice=whole_choice)


async def models(request: Request) -> Response:
    ctx = get_ctx(request)
    dep = _deployment(ctx, request.path_params["deployment_id"])
    adapters = _adapters(ctx, dep)
    data = [{"id": model_id, "object": "model", "created": int(dep.created_at),
             "owned_by": "loops", "parent": None if model_id == dep.base_model
             else dep.base_model, "root": dep.base_model}
            for model_id in _model_ids(dep, adapters)]
    return JSONResponse({"object": "list", "data": data})


# ── every route: OpenAI's error object, never a dropped connection ──

_ROUTES = {"models": "GET", "chat/completions": "POST", "completions": "POST"}


async def _unknown_route(request: Request) -> Response:
    rest = request.path_params["rest"]
    if rest in _ROUTES:
        raise _bad(f"{request.method} is not allowed on /v1/{rest}; use {_ROUTES[rest]}.",
                   None, "MethodNotAllowed", status=405)
    raise _bad(f"No route /v1/{rest} on this deployment: it serves "
               f"{', '.join('/v1/' + r for r in _ROUTES)}.", None, "RouteNotFound", status=404)


def _openai_errors(handler: Callable[[Request], Awaitable[Response]]
                   ) -> Callable[[Request], Awaitable[Response]]:
    """Errors carry OpenAI's ``{"error": {message, type, param, code}}``, which is what
    OpenAI clients show (``detail`` and ``error_class`` stay, as on every route). A bug is
    answered here as a 500 of the same shape: raised on to the app, the server would
    close the kept-alive connection without a word after the 500."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            exc.extra.setdefault("error", openai_error(exc))
            return exc.response(request)
        except Exception as exc:  # noqa: BLE001 - answered, logged with its traceback
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            error = ApiError(500, f"Internal error in the local loops server "
                                  f"({type(exc).__name__}: {exc}). See server.log in the "
                                  "state dir (`loops server logs`).", "InternalServerError")
            error.extra["error"] = openai_error(error)
            return error.response(request)

    return wrapped


def routes() -> list[BaseRoute]:
    every = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    return [
        Route("/deployments/{deployment_id}/v1/models", _openai_errors(models), methods=["GET"]),
        Route("/deployments/{deployment_id}/v1/chat/completions",
              _openai_errors(chat_completions), methods=["POST"]),
        Route("/deployments/{deployment_id}/v1/completions", _openai_errors(completions),
              methods=["POST"]),
        Route("/deployments/{deployment_id}/v1/{rest:path}", _openai_errors(_unknown_route),
              methods=every),
    ]
