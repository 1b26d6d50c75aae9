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
import logging
import time
import uuid
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
from baseten_loops_cli.local.server.errors import ApiError, choices, openai_error
from baseten_loops_cli.local.server.openai_replies import (
    TOOL_CALL_END,
    ReplyParser,
    Vocab,
    merged_delta,
    message_of,
    top_lists,
    usage_dict,
)
from baseten_loops_cli.local.server.openai_requests import (
    CHAT_PARAMS,
    COMPLETION_PARAMS,
    MAX_TOP_LOGPROBS,
    bad,
    flag_field,
    include_usage,
    named_field,
    read_body,
    read_chat_options,
    read_prompts,
    read_sampling,
    reject_unsupported,
    render_chat_prompt,
    sample_job,
)
from baseten_loops_cli.local.server.sampler_routes import int_field
from baseten_loops_cli.local.server.samplers import Adapter
from baseten_loops_cli.local.server.streaming import sse_batch_response

log = logging.getLogger("loops.server.deployments")


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
        raise bad(f"Pass model: one of {choices(_model_ids(dep, adapters))}.", "model",
                   "ModelRequired")
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {model!r}.", "model")
    if model in adapters:
        return adapters[model], model
    if model == dep.base_model:
        return None, model
    if model == dep.name and adapters:
        return next(iter(adapters.values())), model
    raise bad(f"The model {model!r} does not exist on deployment {dep.id}. Available: "
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


async def _prepare(ctx: ServerContext, request: Request, implemented: frozenset[str]
                   ) -> tuple[DeploymentRow, dict, Adapter | None, str, Any, ModelSpec]:
    body = await read_body(request, ctx.config.max_openai_body_bytes)
    dep = _deployment(ctx, request.path_params["deployment_id"])
    reject_unsupported(body, implemented)
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
            include_usage=include_usage(body),
            on_done=lambda outs: usage_dict(prompt_tokens, _record_usage(ctx, dep, outs, model)))

    outs = list(await asyncio.gather(*(ctx.samplers.generate(dep.base_model, job)
                                       for job in jobs)))
    completion_tokens = _record_usage(ctx, dep, outs, model)
    n = jobs[0].n
    return JSONResponse({**head, "object": whole,
                         "choices": [whole_choice(k * n + j, k, s, out)
                                     for k, out in enumerate(outs)
                                     for j, s in enumerate(out.sequences)],
                         "usage": usage_dict(prompt_tokens, completion_tokens)})


# ── chat ──


async def chat_completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep, body, adapter, model, tokenizer, spec = await _prepare(ctx, request, CHAT_PARAMS)
    want_logprobs = flag_field(body, "logprobs") or False
    top_k = named_field("top_logprobs", int_field, body, "top_logprobs", 0, minimum=0,
                   maximum=MAX_TOP_LOGPROBS) or 0
    if top_k and not want_logprobs:
        raise bad("top_logprobs needs logprobs: true.", "top_logprobs")
    sampling = read_sampling(body, scoring=False)
    options = read_chat_options(body, tokenizer)
    prompt = await _off_loop(ctx, dep, render_chat_prompt, tokenizer, body.get("messages"), body)
    stop_ids = _stop_ids(tokenizer)
    job = sample_job(sampling, prompt, spec.max_seq_len, stop_ids, adapter, "messages")
    job.top_logprobs = top_k
    if options.forced is not None:  # the forced call ends with its closing tag
        job.stop = [*job.stop, TOOL_CALL_END]
    vocab = Vocab(tokenizer)

    def reply_parser() -> ReplyParser:
        return ReplyParser(tools=options.parse_tool_calls, reasoning=options.reasoning,
                           forced=options.forced)

    def finish_reason(parser: ReplyParser, reason: str) -> str:
        # vLLM: "tool_calls" when the reply's calls were parsed out of it (not when forced)
        return "tool_calls" if parser.calls and options.forced is None else reason

    parsers: dict[int, ReplyParser] = {}

    def streamed_choice(index: int, kind: str, payload: Any) -> dict | None:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
        parser = parsers.setdefault(index, reply_parser())
        if kind == "start":
            choice["delta"] = {"role": "assistant", "content": ""}
        elif kind == "token":
            text, event = payload
            delta = merged_delta(parser.push(text))
            if want_logprobs:
                choice["logprobs"] = {"content": [
                    vocab.chat_entry(event.token, event.logprob, event.top)]}
            elif not delta:
                return None
            choice["delta"] = delta
        else:
            text, reason = payload
            choice["delta"] = merged_delta(parser.push(text) + parser.finish())
            choice["finish_reason"] = finish_reason(parser, reason)
        return choice

    def whole_choice(index: int, _job_index: int, s: SampledSequence, _out: SampleResult
                     ) -> dict:
        logprobs = {"content": [vocab.chat_entry(t, lp, top) for t, lp, top in zip(
            s.tokens, s.logprobs, top_lists(s))]} if want_logprobs else None
        parser = reply_parser()
        message = message_of(parser.push(s.text) + parser.finish())
        return {"index": index, "message": message,
                "finish_reason": finish_reason(parser, s.finish_reason), "logprobs": logprobs}

    return await _answer(ctx, dep, body, [job], tokenizer, model, id_prefix="chatcmpl",
                         objects=("chat.completion", "chat.completion.chunk"),
                         streamed_choice=streamed_choice, whole_choice=whole_choice)


# ── completions ──


async def completions(request: Request) -> Response:
    ctx = get_ctx(request)
    dep, body, adapter, model, tokenizer, spec = await _prepare(ctx, request, COMPLETION_PARAMS)
    echo = flag_field(body, "echo") or False
    want_logprobs = named_field("logprobs", int_field, body, "logprobs", None, minimum=0,
                           maximum=MAX_TOP_LOGPROBS)
    if echo and want_logprobs is not None and body.get("stream"):
        raise bad("echo with logprobs cannot be streamed here (the prompt's logprobs come "
                   "with the whole answer); drop stream.", "echo")
    sampling = read_sampling(body, scoring=echo)
    prompts = await _off_loop(ctx, dep, read_prompts, body.get("prompt"), tokenizer, spec)
    stop_ids = _stop_ids(tokenizer)
    jobs = []
    for i, (ids, _) in enumerate(prompts):
        job = sample_job(sampling, ids, spec.max_seq_len, stop_ids, adapter,
                   "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        job.top_logprobs = want_logprobs or 0
        if echo and want_logprobs is not None:
            job.prompt_logprobs = want_logprobs
        jobs.append(job)
    vocab = Vocab(tokenizer)
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
            tops: list[list[tuple[int, float]] | None] = list(top_lists(s))
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
        raise bad(f"{request.method} is not allowed on /v1/{rest}; use {_ROUTES[rest]}.",
                   None, "MethodNotAllowed", status=405)
    raise bad(f"No route /v1/{rest} on this deployment: it serves "
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
