"""Wire shapes of the control plane: request models (pydantic) and response views.

Requests are validated with pydantic and *extra keys are ignored*, like the hosted API
(the SDK sends fields some backends don't know, e.g. ``scope`` on the debug routes).
A validation failure becomes one 400 whose ``detail`` names every bad field.

Views turn store rows into the exact JSON objects of loops-protocol.md §2.3 (LoopsRun,
LoopsSampler, LoopsDeployment, LoopsCheckpoint, ...). URLs are built from the base URL
the client used to reach us, so ``localhost`` vs ``127.0.0.1`` both round-trip.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Literal, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.server.errors import bad_request

LOCAL_USER = {"email": "local@localhost"}
LOCAL_TEAM = {"id": "local", "name": "local"}

# What every local deployment runs on. gpu_count 0 tells usage views "no GPUs held".
LOCAL_INSTANCE_TYPE = {
    "id": "local-cpu",
    "name": "Local CPU",
    "memory_limit_mib": 0,
    "millicpu_limit": 0,
    "gpu_count": 0,
    "gpu_type": None,
    "gpu_memory_limit_mib": None,
}

# What the local engine's adapters cover (q/k/v/o and the MLP projections), in the
# hosted API's vocabulary.
LORA_TARGETS = ("attn", "mlp")

DEFAULT_LORA_RANK = 64  # the API default; the SDK always sends its own (32)
DEFAULT_SCALE_DOWN_DELAY_S = 900


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSessionRequest(_Request):
    training_project_id: str | None = None


class CreateRunRequest(_Request):
    """CreateLoopsRunRequest / CreateLoopsTrainerRequest (the latter minus sampler fields)."""

    session_id: str
    base_model: str
    name: str | None = Field(None, min_length=1, max_length=255)
    max_seq_len: int | None = Field(None, ge=1)
    lora_rank: int = Field(DEFAULT_LORA_RANK, ge=1)
    seed: int | None = None
    scale_down_delay_seconds: int = Field(DEFAULT_SCALE_DOWN_DELAY_S, gt=0, le=3600)
    availability_model: Literal["dedicated", "spot"] = "dedicated"
    replicas: int = Field(1, ge=1)
    path: str | None = None
    reuse_from_run_id: str | None = None
    reuse_from_session_id: str | None = None
    sampler_num_replicas: int | None = Field(None, ge=1)
    base_checkpoint: str | None = None


class CreateSamplerRequest(_Request):
    session_id: str
    availability_model: Literal["dedicated", "spot"] | None = None
    base_model: str | None = None
    run_id: str | None = None
    model_path: str | None = None
    max_seq_length: int | None = Field(None, ge=1)
    num_replicas: int | None = Field(None, ge=1)
    reuse_from_session_id: str | None = None


class ValidateCheckpointRequest(_Request):
    checkpoint_path: str
    run_id: str | None = None


class DeployCheckpointsRequest(_Request):
    checkpoint_ids: list[str] = Field(min_length=1)
    model_name: str | None = Field(None, min_length=1, max_length=255)
    instance_type_id: str | None = None
    hf_secret_name: str | None = None


class MetricsRequest(_Request):
    start_epoch_millis: int | None = None
    end_epoch_millis: int | None = None
    step_seconds: int | None = Field(None, ge=1)
    time_divisor_seconds: int | None = Field(None, ge=1)


ModelT = TypeVar("ModelT", bound=BaseModel)


@overload
async def parse_body(request: Request, model: type[ModelT], *, optional: bool = False) -> ModelT:
    ...


@overload
async def parse_body(request: Request, model: None = None, *,
                     optional: bool = False) -> dict[str, Any]:
    ...


async def parse_body(request: Request, model: type[ModelT] | None = None, *,
                     optional: bool = False) -> ModelT | dict[str, Any]:
    """Every route's JSON body, read one way: any problem is a 400 (``InvalidJson`` for a
    body that is not a JSON object, ``ValidationError`` naming every bad field of ``model``).

    Without ``model`` the object comes back as a dict, for routes whose fields are checked
    by hand (trainer ops, sampling). An empty body is refused unless ``optional``, which
    gives the model's defaults (or ``{}``).
    """
    raw = await request.body()
    if not raw.strip():
        if optional:
            return model() if model is not None else {}
        what = model.__name__ if model is not None else "a JSON object"
        raise bad_request(f"This route needs a JSON body ({what}).", "InvalidJson")
    try:
        payload = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}.", "InvalidJson") from None
    if model is not None:
        return validate(model, payload)
    if not isinstance(payload, dict):
        raise bad_request("Request body must be a JSON object.", "InvalidJson")
    return payload


def validate(model: type[ModelT], payload: Any) -> ModelT:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
            for err in exc.errors()
        )
        raise bad_request(f"Invalid request body: {problems}.", "ValidationError") from None


def base_url_of(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def query_int(request: Request, name: str, default: int, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"Query parameter {name!r} must be an integer, got {raw!r}.",
                          "InvalidQuery") from None
    if minimum is not None and value < minimum:
        raise bad_request(f"Query parameter {name!r} must be >= {minimum}, got {value}.",
                          "InvalidQuery")
    if maximum is not None and value > maximum:
        raise bad_request(f"Query parameter {name!r} must be <= {maximum}, got {value}.",
                          "InvalidQuery")
    return value


# ── views ──────────────────────────────────────────────────────────────────────────────


def trainer_url(base_url: str, run_id: str) -> str:
    return f"{base_url}/trainers/{run_id}"


def sampler_url(base_url: str, sampler_id: str) -> str:
    # The ``/sync`` suffix matters: the SDK strips it and appends ``/wake`` to wake a
    # scaled-to-zero sampler, exactly as on the hosted platform.
    return f"{base_url}/samplers/{sampler_id}/sync"


def sampler_view(base_url: str, sampler: st.SamplerRow) -> dict[str, Any]:
    return {
        "id": sampler.id,
        "base_url": sampler_url(base_url, sampler.id),
        "base_model": sampler.base_model,
        "created_at": st.iso(sampler.created_at),
        # model_id + deployment_id make the SDK treat this as a dedicated sampler: a
        # synchronous /sample, readiness from /v1/models/{model_id}/deployments/{id},
        # and X-Min-Policy-Version weight sync.
        "model_id": sampler.model_id,
        "deployment_id": sampler.deployment_id,
        "status": {"name": sampler.status},
        "user": LOCAL_USER,
        "instance_type": LOCAL_INSTANCE_TYPE,
        "node_count": 1,
        "run_id": sampler.run_id,
        "session_id": sampler.session_id,
        "model_path": sampler.model_path,
        "max_seq_length": sampler.max_seq_length,
        "num_replicas": sampler.num_replicas,
        "policy_version": sampler.policy_version,
        "base_checkpoint": None,
    }


def run_view(base_url: str, run: st.RunRow, sampler: st.SamplerRow | None) -> dict[str, Any]:
    return {
        "id": run.id,
        "session_id": run.session_id,
        "deployment_id": run.deployment_id,
        "name": run.name,
        "base_model": run.base_model,
        "lora_config_version": 1,
        "base_url": trainer_url(base_url, run.id),
        "created_at": st.iso(run.created_at),
        "status": {"name": run.status},
        "user": LOCAL_USER,
        "sampler": sampler_view(base_url, sampler) if sampler else None,
        "base_checkpoint": None,
        "lora_rank": run.lora_rank,
        "max_seq_len": run.max_seq_len,
        "seed": run.seed,
        "scale_down_delay_seconds": run.scale_down_delay_seconds,
        "availability_model": run.availability_model,
        "replicas": run.replicas,
        "policy_version": run.policy_version,
    }


def deployment_view(
    base_url: str, dep: st.DeploymentRow, run: st.RunRow | None, sampler: st.SamplerRow | None
) -> dict[str, Any]:
    return {
        "id": dep.id,
        "active_run_id": run.id if run and run.status == st.RUN_ACTIVE else None,
        "latest_run_id": run.id if run else None,
        "base_model": dep.base_model,
        "base_url": trainer_url(base_url, run.id) if run else None,
        "status": {"name": dep.status},
        "status_reason": dep.status_reason,
        "user": LOCAL_USER,
        "created_at": st.iso(dep.created_at),
        "availability_model": run.availability_model if run else "dedicated",
        "instance_type": LOCAL_INSTANCE_TYPE,
        "node_count": 1,
        "sampler": sampler_view(base_url, sampler) if sampler else None,
    }


def checkpoint_view(cp: st.CheckpointRow) -> dict[str, Any]:
    return {
        "id": cp.pk,
        "checkpoint_id": cp.name,
        "run_id": cp.run_id,
        "target": cp.target,
        "checkpoint_type": "lora",
        "base_model": cp.base_model,
        "lora_adapter_config": {"r": cp.lora_rank},
        "lora_config": {"config_version": 1, "targets": list(LORA_TARGETS),
                        "expert_layout": None},
        "size_bytes": cp.size_bytes,
        "sync_status": "COMPLETE",
        "created_at": st.iso(cp.created_at),
        "expires_at": st.iso(cp.expires_at),
        "policy_version": cp.policy_version,
        "path": cp.bt_path,
    }


def sampler_deployment_view(sampler: st.SamplerRow) -> dict[str, Any]:
    """A dedicated sampler as ``/v1/models/{model_id}/deployments/{id}`` (DeploymentV1)."""
    return {
        "id": sampler.deployment_id, "model_id": sampler.model_id,
        "name": f"sampler-{sampler.id}", "status": sampler.status,
        "created_at": st.iso(sampler.created_at), "is_production": False,
        "is_development": False, "environment": None,
        "active_replica_count": 0 if sampler.status != st.SAMPLER_ACTIVE else 1,
        "sampler_id": sampler.id,
    }


def checkpoint_deployment_view(base_url: str, dep: st.DeploymentRow,
                               checkpoints: Iterable[st.CheckpointRow]) -> dict[str, Any]:
    """A checkpoint deployment as ``/v1/models/{model_id}/deployments/{id}`` (DeploymentV1,
    plus what it serves and where)."""
    return {
        "id": dep.id, "model_id": dep.model_id, "name": dep.name, "status": dep.status,
        "created_at": st.iso(dep.created_at), "is_production": False,
        "is_development": False, "environment": None,
        "active_replica_count": 1 if dep.status == st.SAMPLER_ACTIVE else 0,
        "base_model": dep.base_model,
        "checkpoints": [checkpoint_view(cp) for cp in checkpoints],
        "base_url": f"{base_url}/deployments/{dep.id}",
    }


def iso(ts: float | None) -> str | None:
    """A time as every ``created_at`` on the wire (``store.iso``), for views without a row."""
    return st.iso(ts)


def deactivated_view(ident: str, base_model: str) -> dict[str, Any]:
    return {"id": ident, "base_model": base_model, "user": LOCAL_USER}
