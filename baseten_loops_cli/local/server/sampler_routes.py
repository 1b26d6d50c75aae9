"""A sampler's endpoint, ``/samplers/<sampler_id>/sync`` (loops-protocol.md §3.3).

    POST /sync/sample                    200, an OpenAI-completions body with token ids
    GET  /sync/v1/models                 {"data": [{id, parent}]}: base + live adapter
    GET  /sync/trainers_policy_version   {"policy_version"}: what the live adapter is at
    POST /wake                           bring a scaled-to-zero sampler back

``/sample`` honours ``X-Min-Policy-Version`` (408 while behind) and ``X-Checkpoint-Path``
(pin), and reports the version that served it in ``x-trainers-policy-version``. It takes
vLLM's ``logprobs: k`` (each token's k most likely alternatives, as ``token_id:N`` keys)
and ``stream: true``: completions chunks token by token as the sampler decodes, each with
its ``token_ids`` and text delta (``stream_options.include_usage`` adds the usage chunk).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local.engine.sample_types import SampleRequest, SampleResult
from baseten_loops_cli.local.server.compute import ModelSpec
from baseten_loops_cli.local.server.context import ServerContext, get_ctx
from baseten_loops_cli.local.server.errors import ApiError, bad_request
from baseten_loops_cli.local.server.samplers import SamplerRow
from baseten_loops_cli.local.server.schemas import parse_body
from baseten_loops_cli.local.server.streaming import sse_response
from baseten_loops_cli.local.server.validation import check_token_ids

DEFAULT_MAX_TOKENS = 16  # vLLM's / OpenAI's completions default
MAX_N = 64
MAX_PROMPT_LOGPROBS = 20
POLICY_VERSION_HEADER = "x-trainers-policy-version"


def int_field(body: dict, key: str, default: int | None, *, minimum: int | None = None,
         maximum: int | None = None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"{key} must be an integer, got {value!r}.", "InvalidSampleRequest")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise bad_request(f"{key} must be {bounds}, got {value}.", "InvalidSampleRequest")
    return value


def float_field(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or not lo <= value <= hi):
        raise bad_request(f"{key} must be a number in [{lo}, {hi}], got {value!r}.",
                          "InvalidSampleRequest")
    return float(value)


def top_p_field(body: dict) -> float:
    value = float_field(body, "top_p", 1.0, 0.0, 1.0)
    if value <= 0:
        raise bad_request("top_p must be in (0, 1].", "InvalidSampleRequest")
    return value


def parse_sample_request(body: dict, spec: ModelSpec, max_len: int) -> SampleRequest:
    if body.get("model_input_chunks"):
        raise bad_request(f"{spec.name} is a text-only model; image prompts "
                          "(model_input_chunks) are not supported.", "UnsupportedInput")
    if body.get("structured_outputs"):
        raise bad_request("structured_outputs is not supported by the local sampler.",
                          "UnsupportedInput")
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a non-empty list of token ids.", "InvalidSampleRequest")
    check_token_ids(prompt, spec, "prompt")
    n = int_field(body, "n", 1, minimum=1, maximum=MAX_N)
    room = max_len - len(prompt)
    if room < 1:
        raise bad_request(f"The prompt is {len(prompt)} tokens; this sampler's maximum sequence "
                          f"length is {max_len}, leaving no room to generate.", "SequenceTooLong")
    max_tokens = int_field(body, "max_tokens", None, minimum=1)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    elif len(prompt) + max_tokens > max_len:
        raise bad_request(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                          f"maximum sequence length {max_len}; lower max_tokens to <= {room}.",
                          "SequenceTooLong")
    top_k = int_field(body, "top_k", -1)
    top_k = -1 if top_k is None else top_k
    if top_k == 0 or top_k < -1:
        raise bad_request(f"top_k must be -1 (off) or >= 1, got {top_k}.", "InvalidSampleRequest")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("stop must be a string or a list of strings (token ids go in "
                          "stop_token_ids).", "InvalidSampleRequest")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise bad_request("stop_token_ids must be a list of token ids.", "InvalidSampleRequest")
    check_token_ids(stop_ids, spec, "stop_token_ids")
    prompt_logprobs = int_field(body, "prompt_logprobs", None, minimum=0,
                                maximum=MAX_PROMPT_LOGPROBS)
    top_logprobs = int_field(body, "logprobs", None, minimum=0, maximum=MAX_PROMPT_LOGPROBS)
    return SampleRequest(
        top_logprobs=top_logprobs or 0,
        prompt=list(prompt), n=n or 1, max_tokens=max_tokens,
        temperature=float_field(body, "temperature", 1.0, 0.0, 100.0),
        top_p=top_p_field(body),
        top_k=top_k,
        seed=int_field(body, "seed", None), stop_token_ids=list(stop_ids), stop=list(stop or []),
        prompt_logprobs=prompt_logprobs)


def _logprobs(tokens: list[int], logprobs: list[float],
              tops: list[list[tuple[int, float]]] | None) -> dict[str, Any]:
    return {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs,
            "top_logprobs": [{f"token_id:{t}": lp for t, lp in top} for top in tops]
            if tops else None,
            "text_offset": None}


def completions_body(job: SampleRequest, out: SampleResult, model: str,
                     want_logprobs: bool) -> dict[str, Any]:
    # Per prompt position: token id (as text) -> its logprob, rank and text; None where unscored.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    if out.prompt_logprobs is not None:
        prompt_logprobs = []
        for pos, entry in enumerate(out.prompt_logprobs):
            if entry is None:
                prompt_logprobs.append(None)
                continue
            logprob, rank, top = entry
            actual = job.prompt[pos]
            scored = {str(actual): {"logprob": logprob, "rank": rank,
                                    "decoded_token": out.token_text.get(actual)}}
            for i, (tok, lp) in enumerate(top):
                scored.setdefault(str(tok), {"logprob": lp, "rank": i + 1,
                                             "decoded_token": out.token_text.get(tok)})
            prompt_logprobs.append(scored)
    choices = []
    completion_tokens = 0
    for index, seq in enumerate(out.sequences):
        completion_tokens += len(seq.tokens)
        choices.append({
            "index": index,
            "text": seq.text,
            "token_ids": seq.tokens,
            "logprobs": _logprobs(seq.tokens, seq.logprobs, seq.top_logprobs)
            if want_logprobs else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": None,
            "prompt_token_ids": job.prompt,
            "prompt_logprobs": prompt_logprobs,
        })
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens,
                  "total_tokens": len(job.prompt) + completion_tokens},
    }


def _sampler(ctx: ServerContext, request: Request) -> SamplerRow:
    """The sampler a worker route names. An unknown id is a 404 no retry can change
    (samplers are never deleted), marked as the gateway marks one, or the SDK retries
    ``/sample`` and ``/v1/models`` for an hour (errors.py)."""
    try:
        return ctx.samplers.get(request.path_params["sampler_id"])
    except ApiError as error:
        if error.status == 404:
            error.gateway_code = "sampler_not_found"
        raise


def _header_int(request: Request, name: str) -> int | None:
    raw = request.headers.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"Header {name} must be an integer, got {raw!r}.",
                          "InvalidHeader") from None


async def sample(request: Request) -> Response:
    ctx = get_ctx(request)
    sampler = _sampler(ctx, request)
    ctx.samplers.check_serving(sampler)
    body = await parse_body(request)
    spec = await ctx.models.spec(sampler.base_model)
    job = parse_sample_request(body, spec, sampler.max_seq_length or spec.max_seq_len)
    sampler = ctx.samplers.wake(sampler)  # a request wakes a scaled-to-zero sampler
    adapter, version = await ctx.samplers.choose_adapter(
        sampler, request.headers.get("x-checkpoint-path") or None,
        _header_int(request, "x-min-policy-version"))
    if adapter is not None:
        job.adapter, job.adapter_path, job.adapter_family = adapter.key, adapter.path, adapter.family
    model = adapter.name if adapter else sampler.base_model
    want_logprobs = body.get("logprobs") is not None

    def record(output: SampleResult) -> dict[str, int]:
        generated = sum(len(s.tokens) for s in output.sequences)
        ctx.samplers.record_sample(sampler, generated,
                                   checkpoint_pk=adapter.checkpoint_pk if adapter else None)
        return {"prompt_tokens": len(job.prompt), "completion_tokens": generated,
                "total_tokens": len(job.prompt) + generated}

    if body.get("stream"):
        response = await _stream(ctx, sampler.base_model, job, model, want_logprobs, body, record)
        response.headers[POLICY_VERSION_HEADER] = str(version)
        return response
    output = await ctx.samplers.generate(sampler.base_model, job)
    record(output)
    return JSONResponse(completions_body(job, output, model, want_logprobs),
                        headers={POLICY_VERSION_HEADER: str(version)})


async def _stream(ctx, base_model: str, job: SampleRequest, model: str, want_logprobs: bool,
                  body: dict, record) -> Response:
    """``/sample`` with ``stream: true``: a completions chunk per decoded token, carrying
    its ``token_ids`` (the stop token too, as unstreamed) and text delta."""
    from baseten_loops_cli.tokenization import get_tokenizer

    tokenizer = await asyncio.to_thread(get_tokenizer, base_model)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model}

    def chunk(index: int | None, kind: str, payload: Any) -> dict | None:
        if kind == "usage":
            return {**head, "choices": [], "usage": payload}
        if kind == "start":
            return None
        choice: dict[str, Any] = {"index": index, "text": "", "token_ids": [],
                                  "logprobs": None, "finish_reason": None}
        if kind == "token":
            text, event = payload
            choice["text"], choice["token_ids"] = text, [event.token]
            if want_logprobs:
                choice["logprobs"] = _logprobs([event.token], [event.logprob],
                                               [event.top] if job.top_logprobs else None)
        else:
            choice["text"], choice["finish_reason"] = payload
        return {**head, "choices": [choice]}

    options = body.get("stream_options") or {}
    return await sse_response(ctx.samplers, base_model, job, tokenizer, chunk,
                              include_usage=bool(isinstance(options, dict)
                                                 and options.get("include_usage")),
                              on_done=record)


async def list_models(request: Request) -> Response:
    ctx = get_ctx(request)
    sampler = _sampler(ctx, request)
    data: list[dict[str, Any]] = [{"id": sampler.base_model, "object": "model",
                                   "parent": None, "root": sampler.base_model}]
    live = ctx.samplers.live_adapter(sampler)
    if live is not None:
        data.append({"id": live.name, "object": "model", "parent": sampler.base_model,
                     "root": sampler.base_model, "policy_version": live.version})
    return JSONResponse({"object": "list", "data": data})


async def trainers_policy_version(request: Request) -> Response:
    ctx = get_ctx(request)
    sampler = _sampler(ctx, request)
    return JSONResponse({"policy_version": sampler.policy_version})


async def wake(request: Request) -> Response:
    ctx = get_ctx(request)
    sampler = ctx.samplers.wake(_sampler(ctx, request))
    return JSONResponse({"status": sampler.status, "sampler_id": sampler.id})


async def sampler_health(request: Request) -> Response:
    ctx = get_ctx(request)
    sampler = _sampler(ctx, request)
    return JSONResponse({"status": sampler.status})


def routes() -> list[BaseRoute]:
    return [
        Route("/samplers/{sampler_id}/sync/sample", sample, methods=["POST"]),
        Route("/samplers/{sampler_id}/sync/v1/models", list_models, methods=["GET"]),
        Route("/samplers/{sampler_id}/sync/trainers_policy_version", trainers_policy_version,
              methods=["GET"]),
        Route("/samplers/{sampler_id}/sync/health", sampler_health, methods=["GET"]),
        Route("/samplers/{sampler_id}/wake", wake, methods=["POST"]),
    ]
