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
from baseten_loops_cli.workers.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ExternalRef,
    ForwardBackwardOutput,
    ImageChunk,
    InitTrainerServerResponse,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SampleResult,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ExternalRef",
    "ForwardBackwardOutput",
    "ImageChunk",
    "InitTrainerServerResponse",
    "LoadWeightsResponse",
    "ModelInput",
    "OpFuture",
    "OperationExpiredError",
    "OperationTimeoutError",
    "OptimStepResponse",
    "PolicyVersionUnavailableError",
    "RemoteOpError",
    "SampleResponse",
    "SampleResult",
    "SampleTimeoutError",
    "SampledSequence",
    "SamplerClient",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "ServerShutdownError",
    "TensorData",
    "TrainerClient",
    "UnknownOperationError",
    "WorkerClient",
    "parse_completions",
    "sample_many",
]
