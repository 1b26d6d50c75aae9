"""The server's configuration, its model catalog, and the record of the services routes use."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from baseten_loops_cli import __version__
from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.server.checkpoints import CheckpointFiles
from baseten_loops_cli.local.server.compute import ComputePool, Engine, ModelSpec
from baseten_loops_cli.local.server.errors import ApiError, bad_request, choices
from baseten_loops_cli.local.server.files import Presigner
from baseten_loops_cli.local.server.operations import OperationRegistry

if TYPE_CHECKING:
    from starlette.requests import Request

    from baseten_loops_cli.local.server.runs import RunManager
    from baseten_loops_cli.local.server.samplers import SamplerService


@dataclass
class ServerConfig:
    """Knobs of the local server. Defaults follow the hosted platform; tests shrink the
    time-based ones (e.g. ``op_poll_hold_s``) to keep runs fast."""

    data_dir: Path
    token: str
    # GET /operations/{id} holds this long before answering 408 (hosted: 30 s).
    op_poll_hold_s: float = 30.0
    # Finished op results are kept this long, then polls answer 404 (hosted: ~1 h).
    op_result_ttl_s: float = 3600.0
    # ...and retried submits are deduplicated this long.
    idempotency_window_s: float = 24 * 3600.0
    # GET <trainer>/health waits up to this long for a deploying trainer to come up
    # (under the SDK's 10 s probe timeout), sparing it a 10 s sleep between probes.
    health_hold_s: float = 8.0
    # Presigned file links expire after this long.
    link_ttl_s: int = 3600
    # /sample requests arriving within this window are batched into one engine call.
    sample_batch_window_s: float = 0.01
    max_sample_batch: int = 32
    # /sample with X-Min-Policy-Version holds this long for the adapter to catch up
    # before answering 408 (the SDK then retries).
    min_version_hold_s: float = 10.0
    # Snapshot a run's live state after an optim_step at most this often, so a crash
    # loses at most this much training (a clean stop always snapshots).
    snapshot_interval_s: float = 60.0
    # How often idle runs/samplers are scaled to zero and expired data is cleaned up.
    janitor_interval_s: float = 0.5
    # A sampler stays up at least this long after a /wake or a request, whatever its
    # scale_down_delay_seconds: the official SDK wakes a sampler once and then polls its
    # status every 10 s, so one scaled down between two polls was never seen ready.
    sampler_min_awake_s: float = 30.0
    enable_fault_hooks: bool = False
    # Import torch in the background at startup so the first op doesn't pay for it.
    preload_engine: bool = True


class ModelCatalog:
    """The engine's models by name, for routes and services (the first look imports torch,
    off the event loop)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def all(self) -> dict[str, ModelSpec]:
        try:
            return await asyncio.to_thread(self.engine.models)
        except ImportError as exc:
            raise ApiError(503, f"The local compute engine cannot be loaded ({exc}). Install "
                                "the local extra: pip install 'baseten-loops-cli[local]'.",
                           "EngineUnavailable") from None

    async def find(self, name: str) -> ModelSpec | None:
        """A named model or a local Hugging Face model folder; None if neither."""
        models = await self.all()
        return models.get(name) or await asyncio.to_thread(self.engine.spec, name)

    async def spec(self, name: str) -> ModelSpec:
        """A model by name (or local model directory); 400 listing the available ones."""
        models = await self.all()
        spec = models.get(name) or await asyncio.to_thread(self.engine.spec, name)
        if spec is None:
            raise bad_request(
                f"Unknown base model {name!r}. Models available on the local backend: "
                f"{choices(models)}. (`loops server pull-model NAME` adds one.)",
                "UnknownBaseModel",
            )
        return spec


@dataclass(frozen=True)
class ServerContext:
    """The server's services, each built once by the app factory (``app.create_app``), which
    passes every service the others it needs; routes reach them through ``get_ctx``."""

    config: ServerConfig
    store: st.Store
    engine: Engine
    pool: ComputePool
    presigner: Presigner
    files: CheckpointFiles
    ops: OperationRegistry
    models: ModelCatalog
    samplers: SamplerService
    runs: RunManager
    started_at: float = field(default_factory=time.time)
    version: str = __version__


def get_ctx(request: "Request") -> ServerContext:
    return request.app.state.ctx
