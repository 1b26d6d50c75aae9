"""The local backend as one Starlette app: ``create_app(data_dir, token, ...)``.

Routes (see DEVELOPERS.md, "Local backend URLs"):

- control plane ``/v1/loops/*`` (+ team twins, ``/v1/teams``, ``/v1/models/...``)
- trainers ``/trainers/<run_id>/*``, samplers ``/samplers/<sampler_id>/*``
- presigned files ``/files/<checkpoint_pk>/<path>``
- checkpoint deployments ``/deployments/<id>/v1/*``
- ``/health`` (no auth), ``/v1/local/status``, ``/v1/local/usage`` (``local_routes``),
  ``/v1/local/models/pull`` (streamed progress), and with
  ``enable_fault_hooks`` the test-only ``/v1/local/faults``

This module is the composition root: it builds the store and every service on it once,
hands each the others it needs, and puts the services (not the store) in the
``ServerContext`` the routes read.

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
from starlette.routing import Route

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.server import (
    control_plane,
    deployments,
    local_routes,
    model_routes,
    sampler_routes,
    trainer_routes,
)
from baseten_loops_cli.local.server.account import UserAccount
from baseten_loops_cli.local.server.auth import TokenAuthMiddleware
from baseten_loops_cli.local.server.checkpoint_catalog import CheckpointCatalog
from baseten_loops_cli.local.server.checkpoints import CheckpointFiles
from baseten_loops_cli.local.server.compute import ComputePool, Engine
from baseten_loops_cli.local.server.config import ServerConfig
from baseten_loops_cli.local.server.context import ServerContext
from baseten_loops_cli.local.server.deployment_registry import DeploymentRegistry
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
from baseten_loops_cli.local.server.files import Presigner, load_or_create_secret
from baseten_loops_cli.local.server.model_catalog import ModelCatalog
from baseten_loops_cli.local.server.operations import OperationRegistry
from baseten_loops_cli.local.server.runs import RunManager
from baseten_loops_cli.local.server.samplers import SamplerService
from baseten_loops_cli.local.server.usage import UsageLedger

log = logging.getLogger("loops.server")


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
            ctx.checkpoints.expire(now)
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
    engine = engine or Engine(cfg.dtype, cfg.device, cfg.activation_checkpointing)
    pool = ComputePool(engine)
    files = CheckpointFiles(cfg.data_dir)
    ops = OperationRegistry(store, result_ttl_s=cfg.op_result_ttl_s,
                            idempotency_window_s=cfg.idempotency_window_s)
    models = ModelCatalog(engine, store)
    presigner = Presigner(load_or_create_secret(cfg.data_dir), cfg.link_ttl_s)
    samplers = SamplerService(cfg, store, pool, files, models)
    runs = RunManager(cfg, store, pool, files, ops, models, samplers)
    checkpoints = CheckpointCatalog(store, files, presigner)
    ctx = ServerContext(
        config=cfg, engine=engine, pool=pool, presigner=presigner, files=files, ops=ops,
        models=models, samplers=samplers, runs=runs, checkpoints=checkpoints,
        deployments=DeploymentRegistry(store, runs, samplers, checkpoints),
        account=UserAccount(store), usage=UsageLedger(store))
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
            store.close()

    routes = [
        *local_routes.routes(),
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
