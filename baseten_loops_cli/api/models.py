"""Pydantic v2 models of the control-plane API (§2.2-§2.4).

Conventions:

* Responses keep unknown fields (``extra="allow"``): a newer server's fields survive a
  round-trip through ``--output json``.
* Status fields are plain ``str`` (``status.name``), never an enum: a status this client does not
  know yet must not crash a ``list``. The enums below and the ``is_live`` / ``is_terminal``
  helpers classify them.
* ``created_at`` parses to a timezone-aware ``datetime`` (a naive value is taken as UTC) and
  serialises back as ISO 8601 UTC (``2025-01-02T03:04:05Z``).
* Envelopes (``{"run": ...}``, ``{"runs": [...]}``) have their own models with the exact keys.
* Fields the protocol does not promise (the local backend's additions: a run's
  ``policy_version``, a trainer deployment's ``status_reason``, a sampler's ``run_id`` /
  ``model_path``, a checkpoint's ``path``, a checkpoint deployment's ``base_url``, ...) are
  declared, so code reads attributes, and listed in the class's ``SENT_ONLY``: they are dumped
  only when the backend sent them, so a round trip gives back exactly what came.
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializerFunctionWrapHandler,
    model_serializer,
)

# ── base classes and shared field types ─────────────────────────────────────────────────────


class LoopsModel(BaseModel):
    """Base of every response model: unknown fields are kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, protected_namespaces=(), defer_build=True)

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready dict (datetimes as ISO 8601 UTC), unknown fields included."""
        return self.model_dump(mode="json", by_alias=True)


class _SentOnly(LoopsModel):
    """Base of models with fields in ``SENT_ONLY``: declared, but dumped only when sent."""

    SENT_ONLY: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unsent(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self.SENT_ONLY - self.model_fields_set:
                data.pop(name, None)
        return data


class LoopsRequest(BaseModel):
    """Base of request bodies. Extra keys are allowed (and sent) so a caller can pass a field
    a newer server understands; ``None`` fields are left out of the body."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, protected_namespaces=(), defer_build=True)

    def to_body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True, by_alias=True)


def _to_aware(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # epoch seconds / millis / nanos, by magnitude
        v = float(value)
        if v > 1e17:
            v /= 1e9
        elif v > 1e14:
            v /= 1e6
        elif v > 1e11:
            v /= 1e3
        return datetime.fromtimestamp(v, tz=timezone.utc)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        value = datetime.fromisoformat(text)
    if isinstance(value, datetime) and value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value


def _iso_utc(value: datetime) -> str:
    return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


UtcDatetime = Annotated[datetime, BeforeValidator(_to_aware), PlainSerializer(_iso_utc, return_type=str, when_used="json")]


class StatusRef(LoopsModel):
    """``status: {name: "..."}``."""

    name: str = ""


class User(LoopsModel):
    email: str | None = None


# ── status enums (§2.4) ─────────────────────────────────────────────────────────────────────


class RunStatus(StrEnum):
    ACTIVE = "ACTIVE"
    INACTIVE = "INACTIVE"
    FAILED = "FAILED"  # not in the schema; truss treats it as inactive

    @classmethod
    def is_live(cls, status: str | None) -> bool:
        return (status or "").upper() == cls.ACTIVE


class TrainerDeploymentStatus(StrEnum):
    """``LoopsDeploymentStatus``."""

    CREATED = "CREATED"
    DEPLOYING = "DEPLOYING"
    RUNNING = "RUNNING"
    SCALED_TO_ZERO = "SCALED_TO_ZERO"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"

    @classmethod
    def is_live(cls, status: str | None) -> bool:
        return (status or "").upper() in TRAINER_LIVE

    @classmethod
    def is_terminal(cls, status: str | None) -> bool:
        return (status or "").upper() in TRAINER_TERMINAL


TRAINER_LIVE = frozenset({"CREATED", "DEPLOYING", "RUNNING"})
TRAINER_TERMINAL = frozenset({"FAILED", "STOPPED", "PREEMPTED"})


class SamplerDeploymentStatus(StrEnum):
    """``DeploymentStatusV1`` (14 values): samplers and Baseten model deployments."""

    BUILDING = "BUILDING"
    DEPLOYING = "DEPLOYING"
    DEPLOY_FAILED = "DEPLOY_FAILED"
    LOADING_MODEL = "LOADING_MODEL"
    ACTIVE = "ACTIVE"
    UNHEALTHY = "UNHEALTHY"
    BUILD_FAILED = "BUILD_FAILED"
    BUILD_STOPPED = "BUILD_STOPPED"
    DEACTIVATING = "DEACTIVATING"
    INACTIVE = "INACTIVE"
    FAILED = "FAILED"
    UPDATING = "UPDATING"
    SCALED_TO_ZERO = "SCALED_TO_ZERO"
    WAKING_UP = "WAKING_UP"

    @classmethod
    def is_live(cls, status: str | None) -> bool:
        return (status or "").upper() in SAMPLER_LIVE

    @classmethod
    def is_terminal(cls, status: str | None) -> bool:
        return (status or "").upper() in SAMPLER_TERMINAL

    @classmethod
    def is_unrecoverable(cls, status: str | None) -> bool:
        return (status or "").upper() in SAMPLER_UNRECOVERABLE


DeploymentStatusV1 = SamplerDeploymentStatus
SAMPLER_LIVE = frozenset({"ACTIVE", "BUILDING", "DEPLOYING", "LOADING_MODEL", "UPDATING", "WAKING_UP"})
SAMPLER_TERMINAL = frozenset(
    {"DEPLOY_FAILED", "UNHEALTHY", "BUILD_FAILED", "BUILD_STOPPED", "DEACTIVATING", "INACTIVE", "FAILED"}
)
SAMPLER_UNRECOVERABLE = frozenset({"DEPLOY_FAILED", "BUILD_FAILED", "BUILD_STOPPED"})


class CheckpointTarget(StrEnum):
    sampler = "sampler"
    trainer = "trainer"


class _HasStatus(_SentOnly):
    """Mixin: ``status_name`` for models with a ``status: {name}`` field (declared per class so
    it keeps its place in the field order)."""

    @property
    def status_name(self) -> str:
        status = getattr(self, "status", None)
        return status.name if isinstance(status, StatusRef) else ""


# ── resources ───────────────────────────────────────────────────────────────────────────────


class Session(LoopsModel):
    id: str


class InstanceType(LoopsModel):
    id: str
    name: str = ""
    memory_limit_mib: int | None = None
    millicpu_limit: int | None = None
    gpu_count: int = 0
    gpu_type: str | None = None
    gpu_memory_limit_mib: int | None = None


class LoopsSampler(_HasStatus):
    id: str
    base_url: str = ""
    base_model: str = ""
    created_at: UtcDatetime | None = None
    model_id: str | None = None  # null = serverless
    deployment_id: str | None = None
    status: StatusRef = Field(default_factory=StatusRef)
    user: User | None = None
    instance_type: InstanceType | None = None
    node_count: int = 1
    # Sent by the local backend only:
    session_id: str | None = None
    run_id: str | None = None  # the run of a paired sampler (None: standalone)
    model_path: str | None = None  # the bt:// sampler checkpoint a standalone sampler serves
    policy_version: int | None = None  # the adapter version it serves now

    SENT_ONLY = frozenset({"session_id", "run_id", "model_path", "policy_version"})

    @property
    def is_serverless(self) -> bool:
        return self.model_id is None

    @property
    def is_live(self) -> bool:
        return SamplerDeploymentStatus.is_live(self.status_name)


class LoopsRun(_HasStatus):
    id: str
    session_id: str | None = None
    deployment_id: str | None = None  # null = serverless trainer
    name: str | None = None
    base_model: str = ""
    lora_config_version: int | str | None = None
    base_url: str = ""
    created_at: UtcDatetime | None = None
    status: StatusRef = Field(default_factory=StatusRef)
    user: User | None = None
    sampler: LoopsSampler | None = None
    base_checkpoint: str | None = None
    policy_version: int | None = None  # optimizer steps taken (local backend only)

    SENT_ONLY = frozenset({"policy_version"})

    @property
    def is_active(self) -> bool:
        return RunStatus.is_live(self.status_name)


class LoopsDeployment(_HasStatus):
    id: str
    active_run_id: str | None = None
    latest_run_id: str | None = None
    base_model: str = ""
    base_url: str = ""
    status: StatusRef = Field(default_factory=StatusRef)
    user: User | None = None
    created_at: UtcDatetime | None = None
    availability_model: str = "dedicated"
    instance_type: InstanceType | None = None
    node_count: int = 1
    sampler: LoopsSampler | None = None
    status_reason: str | None = None  # why it FAILED or STOPPED (local backend only)

    SENT_ONLY = frozenset({"status_reason"})

    @property
    def is_live(self) -> bool:
        return TrainerDeploymentStatus.is_live(self.status_name)

    @property
    def is_terminal(self) -> bool:
        return TrainerDeploymentStatus.is_terminal(self.status_name)


class LoraConfig(LoopsModel):
    config_version: int | str | None = None
    targets: list[str] = Field(default_factory=list)
    expert_layout: str | None = None  # per_expert | shared_outer | shared_adapter


class LoopsCheckpoint(_SentOnly):
    id: str = ""  # database key, used in API paths
    checkpoint_id: str  # the name it was saved under
    run_id: str
    target: str | None = None  # CheckpointTarget value (str: unknown targets must not crash)
    checkpoint_type: str = ""
    base_model: str | None = None
    lora_adapter_config: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    size_bytes: int = 0
    sync_status: str | None = None  # not a readiness signal
    created_at: UtcDatetime | None = None
    path: str | None = None  # its bt:// URI (local backend only)

    SENT_ONLY = frozenset({"path"})

    @property
    def uri(self) -> str:
        """``bt://loops:<run>/{weights|sampler_weights}/<name>``."""
        directory = "weights" if self.target == CheckpointTarget.trainer else "sampler_weights"
        return f"bt://loops:{self.run_id}/{directory}/{self.checkpoint_id}"

    @property
    def lora_rank(self) -> int | None:
        cfg = self.lora_adapter_config or {}
        rank = cfg.get("r", cfg.get("rank"))
        return int(rank) if isinstance(rank, (int, float)) else None


class CheckpointFile(LoopsModel):
    url: str
    relative_file_name: str
    node_rank: int = 0
    size_bytes: int = 0
    last_modified: UtcDatetime | str | None = None


class CheckpointFilesResponse(LoopsModel):
    presigned_urls: list[CheckpointFile] = Field(default_factory=list)
    next_page_token: int | None = None
    total_count: int = 0


class DebugArchiveFilesResponse(LoopsModel):
    presigned_urls: list[CheckpointFile] = Field(default_factory=list)
    next_page_token: str | None = None


class CheckpointSource(LoopsModel):
    """``{kind: "s3"}`` or ``{kind: "volume", volume_ref, path}`` (other kinds are kept)."""

    kind: str
    volume_ref: str | None = None
    path: str | None = None


class CheckpointSourceResponse(LoopsModel):
    source: CheckpointSource


class EnablementDetails(LoopsModel):
    reason: str | None = None  # needs_approval | sequence_length_unsupported | loops_not_enabled
    reason_detail: str | None = None
    remediation: str | None = None


class SupportedModel(LoopsModel):
    model_name: str
    max_seq_len: int | None = None
    max_enabled_seq_len: int | None = None  # 0 = unusable here
    max_context_length: int | None = None  # deprecated copy of max_seq_len
    supports_vision_language: bool = False
    enabled: bool = True
    serverless: bool | None = None
    enablement_details: EnablementDetails | None = None


class UserConfig(LoopsModel):
    trainer_accelerator_priority: list[str] | None = None
    sampler_accelerator_priority: list[str] | None = None


class Team(LoopsModel):
    id: str
    name: str = ""


class Log(LoopsModel):
    timestamp: str  # epoch nanoseconds as a string
    message: str = ""
    replica: str | None = None
    request_id: str | None = None
    level: str | None = None

    @property
    def time(self) -> datetime | None:
        try:
            return datetime.fromtimestamp(int(self.timestamp) / 1e9, tz=timezone.utc)
        except (TypeError, ValueError):
            return None


class DeactivateResponse(LoopsModel):
    id: str
    base_model: str | None = None
    user: User | None = None


class DeployCheckpointsResponse(LoopsModel):
    model_id: str
    deployment_id: str


class MetricPoint(LoopsModel):
    value: float | None = None
    timestamp: UtcDatetime | str | float | None = None


class DeploymentMetrics(LoopsModel):
    inference_volume: list[MetricPoint] = Field(default_factory=list)
    concurrent_requests: list[MetricPoint] = Field(default_factory=list)
    response_time_stats: list[Any] = Field(default_factory=list)
    inference_volume_by_status: list[Any] = Field(default_factory=list)
    gpu_memory_usage_bytes: dict[str, list[MetricPoint]] = Field(default_factory=dict)
    gpu_utilization: dict[str, list[MetricPoint]] = Field(default_factory=dict)
    cpu_usage: list[MetricPoint] = Field(default_factory=list)
    cpu_memory_usage_bytes: list[MetricPoint] = Field(default_factory=list)
    ephemeral_storage: Any = None
    per_node_metrics: list[Any] = Field(default_factory=list)


class DeploymentMetricsResponse(LoopsModel):
    deployment_id: str | None = None
    metrics: DeploymentMetrics = Field(default_factory=DeploymentMetrics)


class ModelDeployment(_SentOnly):
    """``GET /v1/models/{model_id}/deployments/{deployment_id}`` (a Baseten model deployment).

    There ``status`` is a bare DeploymentStatusV1 string; a ``{name}`` object is accepted too.
    The local backend describes a checkpoint deployment with ``base_model``, ``checkpoints``
    and ``base_url`` (its OpenAI routes are under ``{base_url}/v1``).
    """

    id: str | None = None
    status: str | StatusRef | None = None
    model_id: str | None = None
    name: str | None = None
    created_at: str | None = None  # as sent (shown as is)
    base_model: str | None = None
    checkpoints: list[dict[str, Any]] | None = None  # LoopsCheckpoint JSON
    base_url: str | None = None

    SENT_ONLY = frozenset({"model_id", "name", "created_at", "base_model", "checkpoints", "base_url"})

    @property
    def status_name(self) -> str:
        if isinstance(self.status, StatusRef):
            return self.status.name
        return self.status or ""

    @property
    def is_ready(self) -> bool:
        return self.status_name.upper() == SamplerDeploymentStatus.ACTIVE


# ── envelopes ───────────────────────────────────────────────────────────────────────────────


class SessionResponse(LoopsModel):
    session: Session


class RunResponse(LoopsModel):
    run: LoopsRun


class RunsResponse(LoopsModel):
    runs: list[LoopsRun] = Field(default_factory=list)


class SamplerResponse(LoopsModel):
    sampler: LoopsSampler


class SamplersResponse(LoopsModel):
    samplers: list[LoopsSampler] = Field(default_factory=list)


class CheckpointsResponse(LoopsModel):
    checkpoints: list[LoopsCheckpoint] = Field(default_factory=list)


class DeploymentResponse(LoopsModel):
    deployment: LoopsDeployment


class DeploymentsResponse(LoopsModel):
    deployments: list[LoopsDeployment] = Field(default_factory=list)


class CapabilitiesResponse(LoopsModel):
    supported_models: list[SupportedModel] = Field(default_factory=list)


class UserConfigResponse(LoopsModel):
    user_config: UserConfig = Field(default_factory=UserConfig)


class TeamsResponse(LoopsModel):
    teams: list[Team] = Field(default_factory=list)


class LogsResponse(LoopsModel):
    logs: list[Log] = Field(default_factory=list)


# ── requests ────────────────────────────────────────────────────────────────────────────────


class CreateSessionRequest(LoopsRequest):
    training_project_id: str | None = None


class CreateTrainerRequest(LoopsRequest):
    """``POST /v1/loops/trainers`` (trainer only). ``None`` fields are omitted so the server's
    defaults apply (lora_rank 64, scale_down_delay_seconds 900, ...)."""

    session_id: str
    base_model: str
    name: str | None = Field(default=None, min_length=1, max_length=255)
    max_seq_len: int | None = Field(default=None, ge=1)
    lora_rank: int | None = Field(default=None, ge=1)
    seed: int | None = None
    scale_down_delay_seconds: int | None = Field(default=None, gt=0, le=3600)
    availability_model: Literal["dedicated", "spot"] | None = None
    replicas: int | None = Field(default=None, ge=1)
    path: str | None = None  # bt://loops:<run>/weights/<name>, loaded on startup
    reuse_from_run_id: str | None = None
    reuse_from_session_id: str | None = None  # deprecated
    base_checkpoint: str | None = None  # hf://org/repo[@rev]; only sent when set


class CreateRunRequest(CreateTrainerRequest):
    """``POST /v1/loops/runs``: trainer plus its paired sampler."""

    sampler_num_replicas: int | None = Field(default=None, ge=1)


class CreateSamplerRequest(LoopsRequest):
    """Exactly one of ``base_model`` (standalone), ``run_id`` (paired) or ``model_path``."""

    session_id: str
    base_model: str | None = None
    run_id: str | None = None
    model_path: str | None = None  # bt://loops:<run>/sampler_weights/<name>
    availability_model: Literal["dedicated", "spot"] | None = None
    max_seq_length: int | None = Field(default=None, ge=1)  # sic: not max_seq_len
    reuse_from_session_id: str | None = None
    num_replicas: int | None = Field(default=None, ge=1)


class ValidateCheckpointRequest(LoopsRequest):
    checkpoint_path: str
    run_id: str | None = None


class DeployCheckpointsRequest(LoopsRequest):
    checkpoint_ids: list[str] = Field(min_length=1)
    model_name: str
    instance_type_id: str
    hf_secret_name: str | None = None


class UserConfigPatch(LoopsRequest):
    """PATCH semantics: a list sets, ``None`` clears, an omitted field is unchanged; ``[]`` is
    rejected by the server. Build it with only the fields to change."""

    trainer_accelerator_priority: list[str] | None = None
    sampler_accelerator_priority: list[str] | None = None

    def to_body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


class MetricsRequest(LoopsRequest):
    start_epoch_millis: int | None = None
    end_epoch_millis: int | None = None
    step_seconds: int | None = None
    time_divisor_seconds: int | None = None
