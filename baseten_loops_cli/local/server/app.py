"""The local backend as one Starlette app: ``create_app(data_dir, token, ...)``.

Routes (see DEVELOPERS.md, "Local backend URLs"):

- control plane ``/v1/loops/*`` (+ team twins, ``/v1/teams``, ``/v1/models/...``)
- trainers ``/trainers/<run_id>/*``, samplers ``/samplers/<sampler_id>/*``
- presigned files ``/files/<checkpoint_pk>/<path>``
- checkpoint deployments ``/deployments/<id>/v1/*``
- ``/health`` (no auth), ``/v1/local/status``, ``/v1/local/usage``,
  ``/v1/local/models/pull`` (streamed progress), and with
  ``enable_fault_hooks`` the test-only ``/v1/local/faults``

Lifespan: at startup, ops left unfinished by the previous process are failed and active
runs come back scaled to zero; a janitor task scales idle runs/samplers to zero and
expires op results and TTL'd checkpoints. At shutdown every loaded trainer is saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.server import (
    control_plane,
    deployments,
    model_routes,
    sampler_routes,
    trainer_routes,
)
from baseten_loops_cli.local.server.auth import TokenAuthMiddleware
from baseten_loops_cli.local.server.checkpoints import CheckpointFiles
from baseten_loops_cli.local.server.compute import ComputePool, Engine
from baseten_loops_cli.local.server.context import (
    ModelCatalog,
    ServerConfig,
    ServerContext,
    get_ctx,
)
from baseten_loops_cli.local.server.errors import (
    ApiError,
    api_error_handler,
    http_exception_handler,
    unhandled_error_handler,
)
from baseten_loops_cli.local.server.faults import (
    FAULTS_PATH,
    FaultInjector,
    FaultMiddleware,
    faults_endpoint,
)
from baseten_loops_cli.local.server.files import (
    Presigner,
    file_response,
    load_or_create_secret,
    safe_relative_path,
)
from baseten_loops_cli.local.server.operations import OperationRegistry
from baseten_loops_cli.local.server.runs import RunManager
from baseten_loops_cli.local.server.samplers import SamplerService

log = logging.getLogger("loops.server")


# ── local-only routes ──

async def health(request: Request) -> Response:
    ctx = get_ctx(request)
    return JSONResponse({"status": "ok", "version": ctx.version})


async def local_status(request: Request) -> Response:
    ctx = get_ctx(request)
    runs = ctx.store.list_runs(status=st.RUN_ACTIVE)
    return JSONResponse({
        "version": ctx.version,
        "started_at": st.iso(ctx.started_at),
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "data_dir": str(ctx.config.data_dir),
        "engine_loaded": ctx.engine.loaded,
        "models": ctx.pool.status(),
        "active_runs": len(runs),
        "runs_in_memory": ctx.runs.loaded_runs(),
        "sampling": ctx.samplers.stats(),
        "fault_hooks": ctx.config.enable_fault_hooks,
    })


async def local_usage(request: Request) -> Response:
    """Per-run (and per standalone sampler / deployment) counters, for `loops usage`."""
    ctx = get_ctx(request)
    return JSONResponse({"usage": ctx.store.usage_report(request.query_params.get("run_id"))})


async def presigned_file(request: Request) -> Response:
    ctx = get_ctx(request)
    pk = request.path_params["checkpoint_pk"]
    relative = safe_relative_path(request.path_params["path"])
    ctx.presigner.verify(pk, relative.as_posix(), request.query_params.get("expires"),
                         request.query_params.get("sig"))
    cp = ctx.store.get_checkpoint(pk)
    if cp is None:
        raise ApiError(404, f"Checkpoint {pk} no longer exists (deleted or expired).",
                       "CheckpointNotFound")
    return file_response(request, ctx.files.absolute(cp.storage_dir), relative,
                         sha256=cp.manifest.get(relative.as_posix()))


# ── background work ──

async def _janitor(ctx: ServerContext) -> None:
    """Scale idle runs/samplers to zero; expire op results and TTL'd checkpoints."""
    while True:
        await asyncio.sleep(ctx.config.janitor_interval_s)
        try:
            now = time.time()
            ctx.runs.sweep(now)
            ctx.samplers.sweep(now)
            ctx.ops.expire(now)
            for cp in ctx.store.expired_checkpoints(now):
                ctx.store.delete_checkpoint(cp.pk)
                ctx.files.remove(cp.storage_dir)
                run = ctx.store.get_run(cp.run_id)
                if run is not None:
                    ctx.store.append_log(run.deployment_id, f"Checkpoint {cp.bt_path} expired "
                                                            "(TTL) and was deleted.")
        except Exception:  # keep sweeping; a failure here is logged, not fatal
            log.exception("janitor tick failed")


def create_app(
    data_dir: Path | str,
    token: str,
    *,
    engine: Engine | None = None,
    **config: Any,
) -> Starlette:
    """Build the app. ``config`` overrides :class:`ServerConfig` fields (e.g.
    ``op_poll_hold_s=1`` in tests)."""
    cfg = ServerConfig(data_dir=Path(data_dir), token=token, **config)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    store = st.Store(cfg.data_dir / "loops.db")
    engine = engine or Engine()
    pool = ComputePool(engine)
    files = CheckpointFiles(cfg.data_dir)
    ops = OperationRegistry(store, result_ttl_s=cfg.op_result_ttl_s,
                            idempotency_window_s=cfg.idempotency_window_s)
    models = ModelCatalog(engine)
    samplers = SamplerService(cfg, store, pool, files, models)
    ctx = ServerContext(
        config=cfg, store=store, engine=engine, pool=pool,
        presigner=Presigner(load_or_create_secret(cfg.data_dir), cfg.link_ttl_s),
        files=files, ops=ops, models=models, samplers=samplers,
        runs=RunManager(cfg, store, pool, files, ops, models, samplers))
    faults = FaultInjector()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        failed = ctx.ops.recover_after_restart()
        if failed:
            log.warning("%d operation(s) were in flight at the last shutdown; marked failed",
                        failed)
        ctx.runs.recover_after_restart()
        if cfg.preload_engine:
            threading.Thread(target=ctx.engine.preload, name="loops-preload",
                             daemon=True).start()
        janitor = asyncio.create_task(_janitor(ctx), name="loops-janitor")
        try:
            yield
        finally:
            janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await janitor
            await ctx.runs.shutdown()
            ctx.pool.stop(timeout=10)
            ctx.store.close()

    routes = [
        Route("/health", health, methods=["GET", "HEAD"]),
        Route("/v1/local/status", local_status, methods=["GET"]),
        Route("/v1/local/usage", local_usage, methods=["GET"]),
        Route("/files/{checkpoint_pk}/{path:path}", presigned_file, methods=["GET", "HEAD"]),
        *control_plane.routes(),
        *trainer_routes.routes(),
        *sampler_routes.routes(),
        *deployments.routes(),
        *model_routes.routes(),
    ]
    middleware = [Middleware(TokenAuthMiddleware, token=token)]
    if cfg.enable_fault_hooks:
        routes.append(Route(FAULTS_PATH, faults_endpoint, methods=["GET", "POST", "DELETE"]))
        middleware.append(Middleware(FaultMiddleware, injector=faults))
        ctx.pool.before_job = faults.before_job
        ctx.pool.after_token = faults.after_token
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_exception_handler,
            Exception: unhandled_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.state.faults = faults
    return app
