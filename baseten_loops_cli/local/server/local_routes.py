"""The local-only routes: ``/health`` (no auth), ``/v1/local/status``, ``/v1/local/usage``,
``/v1/local/models`` and the presigned checkpoint files ``/files/<checkpoint_pk>/<path>`` (``files.py`` signs
and serves them). Like every route module they call services, never the store."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local.server.context import get_ctx
from baseten_loops_cli.local.server.errors import ApiError, bad_request
from baseten_loops_cli.local.server.files import file_response, safe_relative_path
from baseten_loops_cli.local.server.schemas import iso, query_int


async def health(request: Request) -> Response:
    ctx = get_ctx(request)
    return JSONResponse({"status": "ok", "version": ctx.version,
                         "backend_id": ctx.config.backend_id or None})


async def local_status(request: Request) -> Response:
    ctx = get_ctx(request)
    return JSONResponse({
        "version": ctx.version,
        "started_at": iso(ctx.started_at),
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "data_dir": str(ctx.config.data_dir),
        "engine_loaded": ctx.engine.loaded,
        "compute": ctx.engine.precision_status(),
        "models": ctx.pool.status(),
        "active_runs": ctx.runs.active_count(),
        "runs_in_memory": ctx.runs.loaded_runs(),
        "sampling": ctx.samplers.stats(),
        "fault_hooks": ctx.config.enable_fault_hooks,
    })


async def local_usage(request: Request) -> Response:
    """Per-run (and per standalone sampler / deployment) counters, for `loops usage`."""
    ctx = get_ctx(request)
    if "since" in request.query_params:  # usage over time: `loops usage --since/--until`
        since = query_int(request, "since", 0, minimum=0)
        until = query_int(request, "until", int(time.time()) + 1, minimum=0)
        period = query_int(request, "period_s", 86400, minimum=60)
        if period % 60:
            raise bad_request(f"Query parameter 'period_s' must be a multiple of 60, got {period}.", "InvalidQuery")
        return JSONResponse({"since": since, "until": until, "period_s": period,
                             "periods": ctx.usage.periods(since, until, period)})
    return JSONResponse({"usage": ctx.usage.report(request.query_params.get("run_id"))})


async def local_models(request: Request) -> Response:
    """The models this server offers (built in, pulled) and the local folders runs used."""
    ctx = get_ctx(request)
    return JSONResponse({"models": await ctx.models.listing()})


async def presigned_file(request: Request) -> Response:
    ctx = get_ctx(request)
    pk = request.path_params["checkpoint_pk"]
    relative = safe_relative_path(request.path_params["path"])
    ctx.presigner.verify(pk, relative.as_posix(), request.query_params.get("expires"),
                         request.query_params.get("sig"))
    cp = ctx.checkpoints.find(pk)
    if cp is None:
        raise ApiError(404, f"Checkpoint {pk} no longer exists (deleted or expired).",
                       "CheckpointNotFound")
    return file_response(request, ctx.checkpoints.folder(cp), relative,
                         sha256=cp.manifest.get(relative.as_posix()))


def routes() -> list[BaseRoute]:
    return [
        Route("/health", health, methods=["GET", "HEAD"]),
        Route("/v1/local/status", local_status, methods=["GET"]),
        Route("/v1/local/usage", local_usage, methods=["GET"]),
        Route("/v1/local/models", local_models, methods=["GET"]),
        Route("/files/{checkpoint_pk}/{path:path}", presigned_file, methods=["GET", "HEAD"]),
    ]
