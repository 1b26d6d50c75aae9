"""Trainer and sampler worker clients (async ops + long-poll) and their wire types.

``from baseten_loops_cli.workers import TrainerClient, SamplerClient, Datum, ModelInput, ...``
imports httpx and pydantic: import this package lazily from CLI code.
"""

from baseten_loops_cli.api.errors import (
    OperationExpiredError,
    OperationTimeoutError,
    PolicyVersionUnavailableError,
    RemoteOpError,
    SampleTimeoutError,
    ServerShutdownError,
    UnknownOperationError,
)
from baseten_loops_cli.workers.sampler import SamplerClient, parse_completions, sample_many
from baseten_loops_cli.workers.client import WorkerClient
from baseten_loops_cli.workers.trainer import OpFuture, TrainerClient
from baseten_loops_cli.workers import types as _types
from baseten_loops_cli.workers.types import *  # noqa: F403 - every wire type, as types.__all__ lists them

__all__ = [
    *_types.__all__,
    "OpFuture",
    "OperationExpiredError",
    "OperationTimeoutError",
    "PolicyVersionUnavailableError",
    "RemoteOpError",
    "SampleTimeoutError",
    "SamplerClient",
    "ServerShutdownError",
    "TrainerClient",
    "UnknownOperationError",
    "WorkerClient",
    "parse_completions",
    "sample_many",
]
