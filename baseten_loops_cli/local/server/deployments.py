"""OpenAI-compatible serving of deployed checkpoints: ``/deployments/<id>/v1/...``.

``POST /v1/loops/checkpoints/deploy`` creates an inference deployment from sampler
checkpoints; this module serves it like a vLLM deployment would:

    GET  /deployments/<id>/v1/models
    POST /deployments/<id>/v1/chat/completions   messages -> chat template -> generate
    POST /deployments/<id>/v1/completions        text (or token ids) -> generate

``model`` selects a deployed checkpoint by its name (as on Baseten: "set the model
parameter to the Loops checkpoint name"), or the base model by its name.

- ``logprobs`` (chat: ``logprobs: true`` + ``top_logprobs: k``; completions: ``logprobs: k``)
  come in OpenAI's shapes, from the sampler's own logprobs (the unmodified distribution the
  trainer agrees with). They cover the tokens of the returned text: a final stop token
  (end of turn), which has no text, is left out.
- ``stream: true`` answers server-sent events token by token as the sampler decodes (the
  engine hands each token over between decode steps): per choice the role delta first,
  then the text, then a chunk with ``finish_reason``; ``stream_options.include_usage``
  adds the usage chunk before ``[DONE]``.
- A parameter this endpoint does not implement is a 400 naming it (unless it has its
  neutral value, e.g. ``presence_penalty: 0``), never silently ignored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.engine.sample_types import (
    SampledSequence,
    SampleRequest,
    SampleResult,
)
from baseten_loops_cli.local.server.context import ServerContext, get_ctx
from baseten_loops_cli.local.server.errors import ApiError, bad_request, choices
from baseten_loops_cli.local.server.schemas import parse_body
from baseten_loops_cli.local.server.sampler_routes import (
    DEFAULT_MAX_TOKENS,
    float_field,
    int_field,
    top_p_field,
)
from baseten_loops_cli.local.server.samplers import Adapter
from baseten_loops_cli.local.server.streaming import sse_response
from baseten_loops_cli.local.server.validation import check_token_ids

MAX_N = 16
MAX_TOP_LOGPROBS = 20  # as vLLM (OpenAI allows 20 on chat, 5 on completions)


def _deployment(ctx: ServerContext, deployment_id: str) -> st.DeploymentRow:
    dep = ctx.store.get_deployment(deployment_id)
    if dep is None or dep.kind != "inference":
        raise ApiError(404, f"No checkpoint deployment {deployment_id!r}. Create one with "
                            "POST /v1/loops/checkpoints/deploy.", "DeploymentNotFound")
    if dep.status != st.SAMPLER_ACTIVE:
        raise ApiError(409, f"Deployment {dep.id} is {dep.status}.", "DeploymentInactive")
    return dep


def _adapters(ctx: ServerContext, dep: st.DeploymentRow) -> dict[str, Adapter]:
    out = {}
    for pk in dep.checkpoint_pks:
        cp = ctx.store.get_checkpoint(pk)
        if cp is not None:
            out[cp.name] = ctx.samplers.adapter(cp)
    return out


def _select(ctx: ServerContext, dep: st.DeploymentRow, model: Any) -> tuple[Adapter | None, str]:
    adapters = _adapters(ctx, dep)
    if model is None:
        if len(adapters) == 1:
            name, adapter = next(iter(adapters.items()))
            return adapter, name
        raise bad_request(f"Pass model: one of {choices([*adapters, dep.base_model])}.",
                          "ModelRequired")
    if model == dep.base_model:
        return None, dep.base_model
    if model in adapters:
        return adapters[model], model
    raise ApiError(404, f"The model {model!r} does not exist on deployment {dep.id}. Available: "
                        f"{choices([*adapters, dep.base_model])}.", "ModelNotFound",
                   extra={"error": {"type": "NotFoundError",
                                    "message": f"The model `{model}` does not exist."}})


async def _tokenizer(base_model: str):
    from baseten_loops_cli.tokenization import get_tokenizer

    return await asyncio.to_thread(get_tokenizer, base_model)


def _stop_ids(tokenizer: Any) -> list[int]:
    """Generation ends at the end of a turn or of the text, as a served model would."""
    stops = list(getattr(tokenizer, "stop_token_ids", ()) or ())
    if not stops and tokenizer.eos_token_id is not None:
        stops = [tokenizer.eos_token_id]
    return stops


def _job(body: dict, prompt: list[int], max_len: int, stop_ids: list[int],
         adapter: Adapter | None) -> SampleRequest:
    room = max_len - len(prompt)
    if room < 1:
        raise bad_request(f"The prompt is {len(prompt)} tokens, leaving no room under the "
                          f"maximum length {max_len}.", "SequenceTooLong")
    max_tokens = int_field(body, "max_tokens", None, minimum=1) or int_field(
        body, "max_completion_tokens", None, minimum=1) or min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise bad_request(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                          f"the maximum length {max_len}; use max_tokens <= {room}.",
                          "SequenceTooLong")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or a list of strings.", "InvalidRequest")
    top_k = int_field(body, "top_k", -1)
    return SampleRequest(
        prompt=prompt, n=int_field(body, "n", 1, minimum=1, maximum=MAX_N) or 1,
        max_tokens=max_tokens, temperature=float_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=top_p_field(body),
        top_k=-1 if top_k in (None, 0) else top_k, seed=int_field(body, "seed", None),
        stop_token_ids=stop_ids, stop=stop, prompt_logprobs=None,
        adapter=adapter.key if adapter else None, adapter_path=adapter.path if adapter else None)


def _reject_unsupported(body: dict, implemented: frozenset[str]) -> None:
    """400 for the first parameter that would change the answer but is not implemented."""
    for key, value in body.items():
        if key in implemented or value is None or value in _NEUTRAL.get(key, ()):
            continue
        raise bad_request(
            f"Unsupported parameter {key!r}: this deployment does not implement it. Remove it "
            f"(implemented: {', '.join(sorted(implemented))}).", "UnsupportedParameter",
            extra={"error": {"message": f"Unsupported parameter: '{key}' (this deployment "
                                        "does not implement it).",
                             "type": "invalid_request_error", "param": key,
                             "code": "unsupported_parameter"}})
    if body.get("stream_options") is not None and not body.get("stream"):
        raise bad_request("stream_options is only allowed with stream: true.", "InvalidRequest")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise bad_request("stream_options takes only include_usage (true or false).",
                          "InvalidRequest")


def _include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _usage(prompt: list[int], completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens}


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

    def completion_logprobs(self, tokens: list[int], logprobs: list[float],
                            tops: list[list[tuple[int, float]]], offset: int) -> dict:
        """A completions ``logprobs`` object; ``offset``: where ``tokens``' text starts."""
        texts = [self.text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": logprobs,
                "top_logprobs": [{self.text(t): lp for t, lp in top} for top in tops],
                "text_offset": offsets}


def _text_token_count(seq: SampledSequence, stop_ids: list[int]) -> int:
    """How many of ``seq``'s tokens have text (all but a final stop token)."""
    if seq.finish_reason == "stop" and seq.tokens and seq.tokens[-1] in stop_ids:
        return len(seq.tokens) - 1
    return len(seq.tokens)


def _tops(seq: SampledSequence, count: int) -> list[list[tuple[int, float]]]:
    return list(seq.top_logprobs or [[] for _ in seq.tokens])[:count]


async def _prepare(ctx: ServerContext, request: Request, implemented: frozenset[str]
                   ) -> tuple[st.DeploymentRow, dict, Adapter | None, str, Any]:
    dep = _deployment(ctx, request.path_params["deployment_id"])
    body = await parse_body(request)
    _reject_unsupported(body, implemented)
    adapter, model = _select(ctx, dep, body.get("model"))
    return dep, body, adapter, model, await _tokenizer(dep.base_model)


def _record_usage(ctx: ServerContext, dep: st.DeploymentRow, out: SampleResult, model: str) -> int:
    """Count the answer for the deployment and (through its checkpoint) for the run it came from."""
    completion_tokens = sum(len(s.tokens) for s in out.sequences)
    adapter = _adapters(ctx, dep).get(model)
    ctx.store.add_usage(dep.id, "deployment", tokens_sampled=completion_tokens,
                        sample_requests=1, checkpoint_pk=adapter.checkpoint_pk if adapter else None)
    return completion_tokens


_CHAT_PARAMS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
    "temperature", "top_p", "top_k", "logprobs", "top_logprobs", "stream", "stream_options",
    "user"})
_COMPLETION_PARAMS = frozenset({
    "model", "prompt", "max_tokens", "n", "stop", "seed", "temperature", "top_p", "top_k",
    "logprobs", "stream", "stream_options", "user"})
# Parameters accepted only at the value that changes nothing (clients often send these).
_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "store": (False,), "modalities": (["text"],), "metadata": ({},),
    "parallel_tool_calls": (False, True), "service_tier": ("auto", "default"),
}


async def _answer(ctx: ServerContext, dep: st.DeploymentRow, body: dict, job: SampleRequest,
                  tokenizer: Any, model: str, *, id_prefix: str, objects: tuple[str, str],
                  streamed_choice: Callable[[int, str, Any], dict | None],
                  whole_choice: Callable[[int, SampledSequence], dict]) -> Response:
    """What both OpenAI routes do once the job is built: stream it as server-sent events
    (``streamed_choice(index, kind, payload)``, kinds as streaming.ChunkBuilder's but for
    "usage", builds a chunk's one choice, or None: nothing to send) or generate it whole
    (``whole_choice(index, sequence)``), and record the usage. ``objects``: the answer's
    ``object`` when whole and when streamed."""
    whole, streamed = objects
    created, ident = int(time.time()), f"{id_prefix}-{uuid.uuid4().hex}"
    head = {"id": ident, "object": streamed, "created": created, "model": model}

    if body.get("stream"):
        def chunk(index: int | None, kind: str, payload: Any) -> dict | None:
            if kind == "usage":
                return {**head, "choices": [], "usage": payload}
            built = streamed_choice(index, kind, payload)
            return None if built is None else {**head, "choices": [built]}

        return await sse_response(ctx.samplers, dep.base_model, job, tokenizer, chunk,
                                  include_usage=_include_usage(body),
                                  on_done=lambda out: _usage(job.prompt,
                                                             _record_usage(ctx, dep, out, model)))

    out = await ctx.samplers.generate(dep.base_model, job)
    completion_tokens = _record_usage(ctx, dep, out, model)
    return JSONResponse({**head, "object": whole,
                         "choices": [whole_choice(i, s) for i, s in enumerate(out.sequences)],
                         "usage": _usage(job.prompt, completion_tokens)})


async def chat_completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep, body, adapter, model, tokenizer = await _prepare(ctx, request, _CHAT_PARAMS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise bad_request("messages must be a non-empty list of {role, content} objects with "
                          "string content.", "InvalidRequest")
    want_logprobs = body.get("logprobs") or False
    if not isinstance(want_logprobs, bool):
        raise bad_request(f"logprobs must be true or false, got {want_logprobs!r}.",
                          "InvalidRequest")
    top_k = int_field(body, "top_logprobs", 0, minimum=0, maximum=MAX_TOP_LOGPROBS) or 0
    if top_k and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", "InvalidRequest")
    from baseten_loops_cli.tokenization import render_chat

    prompt, _ = render_chat(tokenizer, messages, add_generation_prompt=True)
    spec = await ctx.models.spec(dep.base_model)
    stop_ids = _stop_ids(tokenizer)
    job = _job(body, list(prompt), spec.max_seq_len, stop_ids, adapter)
    job.top_logprobs = top_k
    vocab = _Vocab(tokenizer)

    def streamed_choice(index: int, kind: str, payload: Any) -> dict | None:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
        if kind == "start":
            choice["delta"] = {"role": "assistant", "content": ""}
        elif kind == "token":
            text, event = payload
            if want_logprobs and not event.stop_token:
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

    def whole_choice(index: int, s: SampledSequence) -> dict:
        count = _text_token_count(s, stop_ids)
        logprobs = {"content": [vocab.chat_entry(t, lp, top) for t, lp, top in zip(
            s.tokens[:count], s.logprobs, _tops(s, count))]} if want_logprobs else None
        return {"index": index, "message": {"role": "assistant", "content": s.text},
                "finish_reason": s.finish_reason, "logprobs": logprobs}

    return await _answer(ctx, dep, body, job, tokenizer, model, id_prefix="chatcmpl",
                         objects=("chat.completion", "chat.completion.chunk"),
                         streamed_choice=streamed_choice, whole_choice=whole_choice)


async def completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep, body, adapter, model, tokenizer = await _prepare(ctx, request, _COMPLETION_PARAMS)
    raw = body.get("prompt")
    if isinstance(raw, str) and raw:
        prompt = list(tokenizer.encode(raw))
    elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        prompt = list(raw)
    else:
        raise bad_request("prompt must be a non-empty string or list of token ids.",
                          "InvalidRequest")
    want_logprobs = int_field(body, "logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    spec = await ctx.models.spec(dep.base_model)
    check_token_ids(prompt, spec, "prompt")
    stop_ids = _stop_ids(tokenizer)
    job = _job(body, prompt, spec.max_seq_len, stop_ids, adapter)
    job.top_logprobs = want_logprobs or 0
    vocab = _Vocab(tokenizer)
    offsets = [0] * job.n  # streamed: text_offset of each choice's next token

    def streamed_choice(index: int, kind: str, payload: Any) -> dict | None:
        if kind == "start":
            return None  # completions chunks have no role delta
        choice: dict[str, Any] = {"index": index, "text": "", "logprobs": None,
                                  "finish_reason": None}
        if kind == "token":
            text, event = payload
            if want_logprobs is not None and not event.stop_token:
                choice["logprobs"] = vocab.completion_logprobs(
                    [event.token], [event.logprob], [event.top], offsets[index])
                offsets[index] += len(vocab.text(event.token))
            elif not text:
                return None
            choice["text"] = text
        else:
            choice["text"], choice["finish_reason"] = payload
        return choice

    def whole_choice(index: int, s: SampledSequence) -> dict:
        count = _text_token_count(s, stop_ids)
        logprobs = vocab.completion_logprobs(s.tokens[:count], s.logprobs[:count],
                                             _tops(s, count), 0) \
            if want_logprobs is not None else None
        return {"index": index, "text": s.text, "finish_reason": s.finish_reason,
                "logprobs": logprobs}

    return await _answer(ctx, dep, body, job, tokenizer, model, id_prefix="cmpl",
                         objects=("text_completion", "text_completion"),
                         streamed_choice=streamed_choice, whole_choice=whole_choice)


async def models(request: Request) -> Response:
    ctx = get_ctx(request)
    dep = _deployment(ctx, request.path_params["deployment_id"])
    data = [{"id": dep.base_model, "object": "model", "parent": None, "root": dep.base_model}]
    data += [{"id": name, "object": "model", "parent": dep.base_model, "root": dep.base_model}
             for name in _adapters(ctx, dep)]
    return JSONResponse({"object": "list", "data": data})


def _openai_errors(handler: Callable[[Request], Awaitable[Response]]
                   ) -> Callable[[Request], Awaitable[Response]]:
    """Errors also carry OpenAI's ``{"error": {message, type, param, code}}``, which is what
    OpenAI clients show (``detail`` and ``error_class`` stay, as on every route)."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            kind = "invalid_request_error" if exc.status in (400, 404, 409) else "server_error"
            exc.extra.setdefault("error", {"message": exc.detail, "type": kind, "param": None,
                                           "code": exc.error_class})
            raise

    return wrapped


def routes() -> list[BaseRoute]:
    return [
        Route("/deployments/{deployment_id}/v1/models", _openai_errors(models), methods=["GET"]),
        Route("/deployments/{deployment_id}/v1/chat/completions",
              _openai_errors(chat_completions), methods=["POST"]),
        Route("/deployments/{deployment_id}/v1/completions", _openai_errors(completions),
              methods=["POST"]),
    ]
