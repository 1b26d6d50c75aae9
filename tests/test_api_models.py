"""Control-plane models: §2.3 shapes round-trip, unknown fields kept, statuses tolerant."""

from __future__ import annotations

from datetime import timezone

import pytest

from baseten_loops_cli.api import models as m

SAMPLER = {
    "id": "sampler_def789",
    "base_url": "https://model-def789.api.baseten.co/deployment/v1/sync",
    "base_model": "Qwen/Qwen3-8B",
    "created_at": "2025-03-01T12:00:00Z",
    "model_id": "wnpkzp03",
    "deployment_id": "qrpg2r0",
    "status": {"name": "ACTIVE"},
    "user": {"email": "a@b.c"},
    "instance_type": {"id": "H100", "name": "H100:1", "memory_limit_mib": 1, "millicpu_limit": 2, "gpu_count": 1,
                      "gpu_type": "H100", "gpu_memory_limit_mib": 81920},  # fmt: skip
    "node_count": 1,
}
RUN = {
    "id": "k4q95w5",
    "session_id": "session_abc123",
    "deployment_id": "trnr_xyz",
    "name": "my-run",
    "base_model": "Qwen/Qwen3-8B",
    "lora_config_version": 1,
    "base_url": "https://trainer-xyz456.api.baseten.co/trainer",
    "created_at": "2025-03-01T12:00:00Z",
    "status": {"name": "ACTIVE"},
    "user": {"email": "a@b.c"},
    "sampler": SAMPLER,
    "base_checkpoint": None,
}
DEPLOYMENT = {
    "id": "trnr_xyz", "active_run_id": "k4q95w5", "latest_run_id": "k4q95w5", "base_model": "Qwen/Qwen3-8B",
    "base_url": "https://x", "status": {"name": "RUNNING"}, "user": {"email": None}, "created_at": "2025-03-01T12:00:00Z",
    "availability_model": "spot", "instance_type": SAMPLER["instance_type"], "node_count": 2, "sampler": SAMPLER,
}  # fmt: skip
CHECKPOINT = {
    "id": "vL3pQrS8", "checkpoint_id": "step-100", "run_id": "k4q95w5", "target": "sampler", "checkpoint_type": "lora",
    "base_model": "Qwen/Qwen3-8B", "lora_adapter_config": {"r": 32}, "size_bytes": 1234,
    "lora_config": {"config_version": 2, "targets": ["q_proj"], "expert_layout": None},
    "sync_status": "COMPLETE", "created_at": "2025-03-01T12:00:00Z",
}  # fmt: skip


@pytest.mark.parametrize(
    "cls,payload",
    [
        (m.RunResponse, {"run": RUN}),
        (m.RunsResponse, {"runs": [RUN]}),
        (m.SamplersResponse, {"samplers": [SAMPLER]}),
        (m.DeploymentResponse, {"deployment": DEPLOYMENT}),
        (m.CheckpointsResponse, {"checkpoints": [CHECKPOINT]}),
        (m.SessionResponse, {"session": {"id": "session_abc123"}}),
        (m.CheckpointFilesResponse, {"presigned_urls": [{"url": "https://s3/x?sig=1", "relative_file_name": "a.safetensors",
                                     "node_rank": 0, "size_bytes": 5, "last_modified": "2025-03-01T12:00:00Z"}],
                                     "next_page_token": None, "total_count": 1}),  # fmt: skip
        (m.CheckpointSourceResponse, {"source": {"kind": "volume", "volume_ref": "bdn:ns/vol:tag", "path": "dir"}}),
        (m.CapabilitiesResponse, {"supported_models": [{"model_name": "Qwen/Qwen3-0.6B", "max_seq_len": 8192,
                                  "max_enabled_seq_len": 8192, "max_context_length": 8192, "supports_vision_language": False,
                                  "enabled": False, "serverless": True,
                                  "enablement_details": {"reason": "needs_approval", "reason_detail": "x", "remediation": "y"}}]}),  # fmt: skip
        (m.UserConfigResponse, {"user_config": {"trainer_accelerator_priority": ["H100"], "sampler_accelerator_priority": None}}),
        (m.TeamsResponse, {"teams": [{"id": "t1", "name": "Research"}]}),
        (m.LogsResponse, {"logs": [{"timestamp": "1740830400000000000", "message": "hi", "replica": "r0", "request_id": None, "level": "INFO"}]}),
        (m.DeactivateResponse, {"id": "k4q95w5", "base_model": "Qwen/Qwen3-8B", "user": {"email": "a@b.c"}}),
        (m.DeployCheckpointsResponse, {"model_id": "wnpkzp03", "deployment_id": "qrpg2r0"}),
    ],
)
def test_round_trip(cls, payload):
    obj = cls.model_validate(payload)
    assert obj.to_json_dict() == payload


def test_unknown_fields_kept():
    run = m.LoopsRun.model_validate({**RUN, "future_field": {"a": 1}, "sampler": {**SAMPLER, "gpu_hours": 3}})
    out = run.to_json_dict()
    assert out["future_field"] == {"a": 1} and out["sampler"]["gpu_hours"] == 3
    assert run.model_extra == {"future_field": {"a": 1}}


def test_unknown_status_does_not_crash():
    run = m.LoopsRun.model_validate({**RUN, "status": {"name": "HIBERNATING"}})
    assert run.status_name == "HIBERNATING" and not run.is_active
    dep = m.LoopsDeployment.model_validate({**DEPLOYMENT, "status": {"name": "MELTING"}})
    assert not dep.is_live and not dep.is_terminal


def test_status_groups():
    assert set(m.SamplerDeploymentStatus) == {m.SamplerDeploymentStatus(v) for v in m.SAMPLER_LIVE | m.SAMPLER_TERMINAL | {"SCALED_TO_ZERO"}}
    assert len(m.SamplerDeploymentStatus) == 14
    assert m.SamplerDeploymentStatus.is_live("WAKING_UP") and not m.SamplerDeploymentStatus.is_live("SCALED_TO_ZERO")
    assert m.SamplerDeploymentStatus.is_unrecoverable("BUILD_FAILED")
    assert m.TrainerDeploymentStatus.is_live("DEPLOYING") and m.TrainerDeploymentStatus.is_terminal("PREEMPTED")
    assert not m.TrainerDeploymentStatus.is_terminal("SCALED_TO_ZERO")
    assert m.RunStatus.is_live("ACTIVE") and not m.RunStatus.is_live("INACTIVE")


def test_datetimes():
    run = m.LoopsRun.model_validate({**RUN, "created_at": "2025-03-01T14:00:00+02:00"})
    assert run.created_at.tzinfo is not None
    assert run.created_at.astimezone(timezone.utc).hour == 12
    assert run.to_json_dict()["created_at"] == "2025-03-01T12:00:00Z"
    naive = m.LoopsRun.model_validate({**RUN, "created_at": "2025-03-01T12:00:00.5"})
    assert naive.created_at.tzinfo is not None and naive.to_json_dict()["created_at"] == "2025-03-01T12:00:00.500000Z"


def test_checkpoint_helpers():
    ck = m.LoopsCheckpoint.model_validate(CHECKPOINT)
    assert ck.uri == "bt://loops:k4q95w5/sampler_weights/step-100" and ck.lora_rank == 32
    tr = m.LoopsCheckpoint.model_validate({**CHECKPOINT, "target": "trainer", "lora_adapter_config": None})
    assert tr.uri == "bt://loops:k4q95w5/weights/step-100" and tr.lora_rank is None


def test_requests():
    req = m.CreateRunRequest(session_id="s", base_model="b", lora_rank=32, sampler_num_replicas=2)
    assert req.to_body() == {"session_id": "s", "base_model": "b", "lora_rank": 32, "sampler_num_replicas": 2}
    assert m.CreateSamplerRequest(session_id="s", run_id="r", max_seq_length=10).to_body() == {
        "session_id": "s", "run_id": "r", "max_seq_length": 10}  # fmt: skip
    assert m.UserConfigPatch(trainer_accelerator_priority=None).to_body() == {"trainer_accelerator_priority": None}
    assert m.UserConfigPatch(sampler_accelerator_priority=["A"]).to_body() == {"sampler_accelerator_priority": ["A"]}
    with pytest.raises(ValueError):
        m.CreateRunRequest(session_id="s", base_model="b", scale_down_delay_seconds=0)
    extra = m.CreateTrainerRequest(session_id="s", base_model="b", scope="serverless")
    assert extra.to_body()["scope"] == "serverless"


def test_model_deployment_status_string():
    md = m.ModelDeployment.model_validate({"id": "qrpg2r0", "status": "ACTIVE", "name": "x"})
    assert md.is_ready and md.to_json_dict() == {"id": "qrpg2r0", "status": "ACTIVE", "name": "x"}


def test_metrics():
    payload = {"deployment_id": "d", "metrics": {"gpu_utilization": {"0": [{"value": 0.5, "timestamp": "2025-03-01T12:00:00Z"}]},
                                                 "cpu_usage": [{"value": 1.0, "timestamp": "2025-03-01T12:00:00Z"}]}}  # fmt: skip
    r = m.DeploymentMetricsResponse.model_validate(payload)
    assert r.metrics.gpu_utilization["0"][0].value == 0.5


def test_log_time():
    log = m.Log(timestamp="1740830400000000000", message="x")
    assert log.time.year == 2025


def test_local_fields_are_attributes_and_dumped_only_when_sent():
    local_sampler = {**SAMPLER, "run_id": "k4q95w5", "model_path": None, "policy_version": 3, "session_id": "s"}
    run = m.LoopsRun.model_validate({**RUN, "policy_version": 7, "sampler": local_sampler})
    assert run.policy_version == 7 and run.sampler.run_id == "k4q95w5" and run.sampler.policy_version == 3
    assert run.model_extra == {} and run.to_json_dict() == {**RUN, "policy_version": 7, "sampler": local_sampler}
    dep = m.LoopsDeployment.model_validate({**DEPLOYMENT, "status_reason": "out of memory"})
    assert dep.status_reason == "out of memory" and dep.to_json_dict()["status_reason"] == "out of memory"
    cp = m.LoopsCheckpoint.model_validate({**CHECKPOINT, "path": "bt://loops:k4q95w5/sampler_weights/step-100"})
    assert cp.path.startswith("bt://") and "path" not in m.LoopsCheckpoint.model_validate(CHECKPOINT).to_json_dict()
    md = m.ModelDeployment.model_validate({"id": "d", "status": "ACTIVE", "base_url": "http://h/deployments/d"})
    assert md.base_url == "http://h/deployments/d" and md.name is None
    assert md.to_json_dict() == {"id": "d", "status": "ACTIVE", "base_url": "http://h/deployments/d"}
    bare = m.LoopsRun.model_validate(RUN)  # Baseten sends none of them: attributes are None, dumps unchanged
    assert bare.policy_version is None and bare.sampler.run_id is None and bare.to_json_dict() == RUN
