"""OpenAI-compatible serving of deployed checkpoints: ``/deployments/<id>/v1/...``.

``POST /v1/loops/checkpoints/deploy`` creates an inference deployment from sampler
checkpoints; this module serves it like a vLLM deployment would:

    GET  /deployments/<id>/v1/models
    POST /deployments/<id>/v1/chat/completions   messages -> chat template -> generate
    POST /deployments/<id>/v1/completions        text (or token ids) -> generate

``model`` selects a deployed checkpoint by its name (as on Baseten: "set the model
parameter to the Loops checkpoint name"), or the base model by its name. ``stream: true``
is answered as server-sent events (the whole completion in one chunk: the local engine
generates a batch at a time, not token by token).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.engine.sample_types import SampleRequest
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
from baseten_loops_cli.local.server.validation import check_token_ids

MAX_N = 16


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


def _usage(prompt: list[int], completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens}


def _sse(chunks: list[dict]) -> StreamingResponse:
    async def events():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def chat_completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep = _deployment(ctx, request.path_params["deployment_id"])
    body = await parse_body(request)
    adapter, model = _select(ctx, dep, body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise bad_request("messages must be a non-empty list of {role, content} objects with "
                          "string content.", "InvalidRequest")
    from baseten_loops_cli.tokenization import render_chat

    tokenizer = await _tokenizer(dep.base_model)
    prompt, _ = render_chat(tokenizer, messages, add_generation_prompt=True)
    spec = await ctx.models.spec(dep.base_model)
    job = _job(body, list(prompt), spec.max_seq_len, _stop_ids(tokenizer), adapter)
    out = await ctx.samplers.generate(dep.base_model, job)
    created, ident = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    completion_tokens = sum(len(s.tokens) for s in out.sequences)
    ctx.store.add_usage(dep.id, "deployment", tokens_sampled=completion_tokens,
                        sample_requests=1)
    if body.get("stream"):
        chunks = [{"id": ident, "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                     "content": s.text},
                                                "finish_reason": s.finish_reason}]}
                  for i, s in enumerate(out.sequences)]
        return _sse(chunks)
    return JSONResponse({
        "id": ident, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": s.text},
                     "finish_reason": s.finish_reason, "logprobs": None}
                    for i, s in enumerate(out.sequences)],
        "usage": _usage(job.prompt, completion_tokens),
    })


async def completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep = _deployment(ctx, request.path_params["deployment_id"])
    body = await parse_body(request)
    adapter, model = _select(ctx, dep, body.get("model"))
    tokenizer = await _tokenizer(dep.base_model)
    raw = body.get("prompt")
    if isinstance(raw, str) and raw:
        prompt = list(tokenizer.encode(raw))
    elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        prompt = list(raw)
    else:
        raise bad_request("prompt must be a non-empty string or list of token ids.",
                          "InvalidRequest")
    spec = await ctx.models.spec(dep.base_model)
    check_token_ids(prompt, spec, "prompt")
    job = _job(body, prompt, spec.max_seq_len, _stop_ids(tokenizer), adapter)
    out = await ctx.samplers.generate(dep.base_model, job)
    created, ident = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    completion_tokens = sum(len(s.tokens) for s in out.sequences)
    ctx.store.add_usage(dep.id, "deployment", tokens_sampled=completion_tokens,
                        sample_requests=1)
    choices_ = [{"index": i, "text": s.text, "finish_reason": s.finish_reason, "logprobs": None}
                for i, s in enumerate(out.sequences)]
    if body.get("stream"):
        return _sse([{"id": ident, "object": "text_completion", "created": created,
                      "model": model, "choices": [c]} for c in choices_])
    return JSONResponse({"id": ident, "object": "text_completion", "created": created,
                         "model": model, "choices": choices_,
                         "usage": _usage(prompt, completion_tokens)})


async def models(request: Request) -> Response:
    ctx = get_ctx(request)
    dep = _deployment(ctx, request.path_params["deployment_id"])
    data = [{"id": dep.base_model, "object": "model", "parent": None, "root": dep.base_model}]
    data += [{"id": name, "object": "model", "parent": dep.base_model, "root": dep.base_model}
             for name in _adapters(ctx, dep)]
    return JSONResponse({"object": "list", "data": data})


def routes() -> list[BaseRoute]:
    return [
        Route("/deployments/{deployment_id}/v1/models", models, methods=["GET"]),
        Route("/deployments/{deployment_id}/v1/chat/completions", chat_completions,
              methods=["POST"]),
        Route("/deployments/{deployment_id}/v1/completions", completions, methods=["POST"]),
    ]
