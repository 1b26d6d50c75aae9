"""The record of the services routes use (``ServerContext``), built once by ``app.create_app``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baseten_loops_cli import __version__
from baseten_loops_cli.local.server.account import UserAccount
from baseten_loops_cli.local.server.checkpoint_catalog import CheckpointCatalog
from baseten_loops_cli.local.server.checkpoints import CheckpointFiles
from baseten_loops_cli.local.server.compute import ComputePool, Engine
from baseten_loops_cli.local.server.config import ServerConfig
from baseten_loops_cli.local.server.deployment_registry import DeploymentRegistry
from baseten_loops_cli.local.server.files import Presigner
from baseten_loops_cli.local.server.model_catalog import ModelCatalog
from baseten_loops_cli.local.server.operations import OperationRegistry
from baseten_loops_cli.local.server.runs import RunManager
from baseten_loops_cli.local.server.samplers import SamplerService
from baseten_loops_cli.local.server.usage import UsageLedger

if TYPE_CHECKING:
    from starlette.requests import Request

# ServerConfig stays importable from here (tests, scripts); it lives in config.py.
__all__ = ["ServerConfig", "ServerContext", "get_ctx"]


@dataclass(frozen=True)
class ServerContext:
    """The server's services, each built once by the app factory (``app.create_app``), which
    passes every service the others it needs; routes reach them through ``get_ctx``. The
    store is not here: routes ask a service (DEVELOPERS.md, "Local server")."""

    config: ServerConfig
    engine: Engine
    pool: ComputePool
    presigner: Presigner
    files: CheckpointFiles
    ops: OperationRegistry
    models: ModelCatalog
    samplers: SamplerService
    runs: RunManager
    checkpoints: CheckpointCatalog
    deployments: DeploymentRegistry
    account: UserAccount
    usage: UsageLedger
    started_at: float = field(default_factory=time.time)
    version: str = __version__


def get_ctx(request: "Request") -> ServerContext:
    return request.app.state.ctx
