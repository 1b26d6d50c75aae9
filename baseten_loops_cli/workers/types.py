"""Tinker-compatible wire types for the trainer and sampler workers (§3.2).

These mirror ``baseten.loops.models`` (SDK 0.32.0) field for field, so
``model_dump(mode="json")`` produces exactly the JSON the official SDK sends and a body the SDK
produced validates here. Unlike the control-plane models they do not keep unknown fields: they
are request bodies, and an unknown key is far more likely a typo than a server extension.
Result types (``ForwardBackwardOutput`` ...) do ignore unknown keys rather than failing.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Dict, List, Literal, Tuple, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PositiveInt,
    Tag,
    field_serializer,
    field_validator,
)

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "dpo", "dppo"]
LOSS_FNS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "dpo", "dppo")
StopReason = Literal["stop", "length"]
SupportedImageFormat = Literal["png", "jpeg"]


class _Result(BaseModel):
    """Base of the server → client result types: unknown keys are ignored, not errors."""

    model_config = ConfigDict(extra="ignore")


# ── tensors and model inputs ────────────────────────────────────────────────────────────────


class TensorData(BaseModel):
    """A flat tensor: ``data`` in row-major order, ``dtype`` name, ``shape``.

    Masked float positions travel as JSON ``null`` (JSON has no NaN).
    """

    data: list
    dtype: str
    shape: List[int]

    def tolist(self) -> list:
        return list(self.data)

    @classmethod
    def from_list(cls, data: list, dtype: str = "float32") -> "TensorData":
        """From a (possibly nested) list; nested lists are flattened and the shape inferred."""
        shape: list[int] = []
        level: Any = data
        while isinstance(level, list):
            shape.append(len(level))
            level = level[0] if level else None
        flat: list = data
        while flat and isinstance(flat[0], list):
            flat = [x for row in flat for x in row]
        return cls(data=flat, dtype=dtype, shape=shape)

    def to_torch(self):  # pragma: no cover - needs torch
        import torch

        dtypes = {
            "float32": torch.float32,
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "float64": torch.float64,
            "int32": torch.int32,
            "int64": torch.int64,
            "int8": torch.int8,
            "bool": torch.bool,
        }
        torch_dtype = dtypes.get(self.dtype, torch.float32)
        data = self.data
        if torch_dtype.is_floating_point and any(v is None for v in data):
            data = [float("nan") if v is None else v for v in data]
        return torch.tensor(data, dtype=torch_dtype).reshape(self.shape)

    @classmethod
    def from_torch(cls, tensor) -> "TensorData":  # pragma: no cover - needs torch
        return cls(data=tensor.flatten().tolist(), dtype=str(tensor.dtype).replace("torch.", ""), shape=list(tensor.shape))


class EncodedTextChunk(BaseModel):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: List[int]

    @property
    def length(self) -> int:
        return len(self.tokens)


class ImageChunk(BaseModel):
    """Inline image; ``data`` is standard (not URL-safe) base64 on the wire, like the SDK."""

    type: Literal["image"] = "image"
    data: bytes
    format: SupportedImageFormat
    expected_tokens: PositiveInt

    @field_validator("data", mode="before")
    @classmethod
    def _decode(cls, value: bytes | str) -> bytes:
        return base64.b64decode(value) if isinstance(value, str) else value

    @field_serializer("data", when_used="json")
    def _encode(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @property
    def length(self) -> int:
        return self.expected_tokens


ModelInputChunk = Annotated[
    Union[Annotated[EncodedTextChunk, Tag("encoded_text")], Annotated[ImageChunk, Tag("image")]],
    Discriminator("type"),
]


class ModelInput(BaseModel):
    chunks: List[ModelInputChunk] = Field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: List[int]) -> "ModelInput":
        return cls(chunks=[EncodedTextChunk(tokens=list(tokens))])

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(chunks=[])

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def to_ints(self) -> List[int]:
        out: List[int] = []
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):
                raise TypeError(f"Cannot convert {type(chunk).__name__} to ints")
            out.extend(chunk.tokens)
        return out

    def append(self, chunk: EncodedTextChunk | ImageChunk) -> "ModelInput":
        return type(self)(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> "ModelInput":
        return self.append(EncodedTextChunk(tokens=[token]))


class ExternalRef(BaseModel):
    """A logical ``bt://loops:<run>/sequences/<obj>`` reference to an out-of-band payload."""

    uri: str
    version: int = Field(ge=1)


class Datum(BaseModel):
    model_input: ModelInput
    loss_fn_inputs: Dict[str, TensorData] = Field(default_factory=dict)
    routed_experts_ref: ExternalRef | None = None


# ── sampling ────────────────────────────────────────────────────────────────────────────────


class SamplingParams(BaseModel):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | List[str] | List[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    structured_outputs: dict[str, Any] | None = None


class SampledSequence(_Result):
    tokens: List[int] = Field(default_factory=list)
    logprobs: List[float] | None = None
    stop_reason: StopReason = "length"
    text: str | None = None
    routed_experts: ExternalRef | None = None


class SampleResult(_Result):
    """The SDK's ``SampleResponse``: sequences plus the policy version that served them."""

    sequences: List[SampledSequence] = Field(default_factory=list)
    policy_version: int | None = None
    prompt_token_ids: List[int] | None = None
    prompt_logprobs: List[float | None] | None = None
    topk_prompt_logprobs: List[List[Tuple[int, float]] | None] | None = None


SampleResponse = SampleResult  # the SDK's name


# ── training ────────────────────────────────────────────────────────────────────────────────


class AdamParams(BaseModel):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # 0 = disabled


class ForwardBackwardOutput(_Result):
    loss: float = 0.0
    loss_fn_output_type: str = ""
    loss_fn_outputs: List[Dict[str, TensorData]] = Field(default_factory=list)
    metrics: Dict[str, float] = Field(default_factory=dict)


class OptimStepResponse(_Result):
    metrics: Dict[str, float] | None = None


class SaveWeightsResponse(_Result):
    mode: str = ""
    path: str = ""


class SaveWeightsForSamplerResponse(_Result):
    """``version`` = trainer step at publish time (0 = no LoRA, serve base); ``path`` = the
    ``bt://loops:<run>/sampler_weights/<name>`` to pin a sampler to."""

    version: int = 0
    path: str = ""


class LoadWeightsResponse(_Result):
    step: int = 0


class InitTrainerServerResponse(_Result):
    step: int = 0
    lora_rank: int


__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ExternalRef",
    "ForwardBackwardOutput",
    "ImageChunk",
    "InitTrainerServerResponse",
    "LOSS_FNS",
    "LoadWeightsResponse",
    "LossFnType",
    "ModelInput",
    "ModelInputChunk",
    "OptimStepResponse",
    "SampleResponse",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "StopReason",
    "TensorData",
]
