"""LoopsClient routes against a real local HTTP server (paths, params, bodies, envelopes)."""

from __future__ import annotations

import pytest
from fault_server import FaultServer, Reply
from test_api_models import CHECKPOINT, DEPLOYMENT, RUN, SAMPLER

from baseten_loops_cli.api.client import LoopsClient
from baseten_loops_cli.api.errors import NotFoundError, ServerError
from baseten_loops_cli.api.models import CreateRunRequest, CreateTrainerRequest, LoopsRun
from baseten_loops_cli.errors import UsageError


@pytest.fixture
def server():
    srv = FaultServer()
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    c = LoopsClient(server.url, "key-123", sleep=lambda s: None)
    yield c
    c.close()


def last(server):
    return server.requests[-1]


def test_sessions(server, client):
    server.route("POST", "/v1/loops/sessions", lambda r: Reply(200, {"session": {"id": "s1"}}))
    server.route("GET", "/v1/loops/sessions/s1", lambda r: Reply(200, {"session": {"id": "s1"}}))
    assert client.sessions.create().id == "s1"
    assert last(server).body == b""  # the SDK sends no body
    client.sessions.create(training_project_id="p")
    assert last(server).json == {"training_project_id": "p"}
    assert client.sessions.get("s1").id == "s1"


def test_runs(server, client):
    server.route("POST", "/v1/loops/runs", lambda r: Reply(200, {"run": RUN}))
    server.route("POST", "/v1/loops/trainers", lambda r: Reply(200, {"run": {**RUN, "sampler": None}}))
    server.route("GET", "/v1/loops/runs", lambda r: Reply(200, {"runs": [RUN, RUN]}))
    server.route("GET", "/v1/loops/runs/k4q95w5", lambda r: Reply(200, {"run": RUN}))
    server.route("POST", "/v1/loops/runs/k4q95w5/deactivate", lambda r: Reply(200, {"id": "k4q95w5", "base_model": "b", "user": {}}))
    run = client.runs.create(CreateRunRequest(session_id="s", base_model="b", lora_rank=8))
    assert isinstance(run, LoopsRun) and run.sampler.id == "sampler_def789"
    assert last(server).json == {"session_id": "s", "base_model": "b", "lora_rank": 8}
    run = client.runs.create_trainer({"session_id": "s", "base_model": "b", "base_checkpoint": "hf://o/r"})
    assert run.sampler is None and last(server).json["base_checkpoint"] == "hf://o/r"
    assert len(client.runs.list(base_model="b", scope="org")) == 2
    assert last(server).query == {"base_model": ["b"], "scope": ["org"]}
    assert client.runs.get("k4q95w5").id == "k4q95w5"
    assert client.runs.deactivate("k4q95w5").id == "k4q95w5"


def test_team_twins(server):
    c = LoopsClient(server.url, "k", team="team1")
    server.route("POST", "/v1/teams/team1/loops/*", lambda r: Reply(200, {"session": {"id": "s"}, "run": RUN, "sampler": SAMPLER}))
    server.route("GET", "/v1/teams/team1/loops/*", lambda r: Reply(200, {"runs": [], "samplers": []}))
    server.route("GET", "/v1/loops/runs/x", lambda r: Reply(200, {"run": RUN}))
    c.sessions.create()
    c.runs.create({"session_id": "s", "base_model": "b"})
    c.runs.create_trainer({"session_id": "s", "base_model": "b"})
    c.samplers.create({"session_id": "s", "base_model": "b"})
    c.runs.list()
    c.samplers.list()
    c.runs.get("x")  # no team twin
    paths = [(r.method, r.path) for r in server.requests]
    assert paths == [
        ("POST", "/v1/teams/team1/loops/sessions"), ("POST", "/v1/teams/team1/loops/runs"),
        ("POST", "/v1/teams/team1/loops/trainers"), ("POST", "/v1/teams/team1/loops/samplers"),
        ("GET", "/v1/teams/team1/loops/runs"), ("GET", "/v1/teams/team1/loops/samplers"), ("GET", "/v1/loops/runs/x"),
    ]  # fmt: skip
    c.close()


def test_samplers(server, client):
    server.route("POST", "/v1/loops/samplers", lambda r: Reply(200, {"sampler": SAMPLER}))
    server.route("GET", "/v1/loops/samplers/sampler_def789", lambda r: Reply(200, {"sampler": SAMPLER}))
    server.route("POST", "/v1/loops/samplers/*/deactivate", lambda r: Reply(200, {"id": "sampler_def789"}))
    assert client.samplers.create({"session_id": "s", "run_id": "r"}).model_id == "wnpkzp03"
    with pytest.raises(UsageError):
        client.samplers.create({"session_id": "s", "run_id": "r", "base_model": "b"})
    with pytest.raises(UsageError):
        client.samplers.create({"session_id": "s"})
    assert client.samplers.get("sampler_def789").is_live
    assert client.samplers.deactivate("sampler_def789").id == "sampler_def789"


def test_checkpoints_list_filters(server, client):
    server.route("GET", "/v1/loops/checkpoints", lambda r: Reply(200, {"checkpoints": [CHECKPOINT]}))
    assert client.checkpoints.list(run_id="k4q95w5")[0].checkpoint_id == "step-100"
    assert last(server).query == {"run_id": ["k4q95w5"]}
    for bad in ({}, {"run_id": "r", "base_model": "b"}, {"run_id": "r", "checkpoint_path": "bt://x"}):
        with pytest.raises(UsageError):
            client.checkpoints.list(**bad)


def test_checkpoint_path_404_is_empty(server, client):
    server.route("GET", "/v1/loops/checkpoints", lambda r: Reply(404, {"detail": "not found"}))
    assert client.checkpoints.list(checkpoint_path="bt://loops:r/sampler_weights/x") == []
    with pytest.raises(NotFoundError):
        client.checkpoints.list(run_id="r")


def _file(i):
    return {"url": f"https://s3/f{i}?sig=x", "relative_file_name": f"f{i}", "node_rank": 0, "size_bytes": i,
            "last_modified": "2025-03-01T12:00:00Z"}  # fmt: skip


def test_iter_files_pages(server, client):
    def page(req):
        token = int(req.query["page_token"][0])
        nxt = token + 2 if token < 4 else None
        return Reply(200, {"presigned_urls": [_file(token), _file(token + 1)], "next_page_token": nxt, "total_count": 6})

    server.route("GET", "/v1/loops/checkpoints/ck/files", page)
    names = [f.relative_file_name for f in client.checkpoints.iter_files("ck", page_size=2)]
    assert names == ["f0", "f1", "f2", "f3", "f4", "f5"]
    assert [r.query["page_token"][0] for r in server.requests] == ["0", "2", "4"]
    assert server.requests[0].query["page_size"] == ["2"]


def test_iter_files_stops_on_empty_page_and_cap(server, client):
    server.route("GET", "/v1/loops/checkpoints/empty/files",
                 lambda r: Reply(200, {"presigned_urls": [], "next_page_token": 5, "total_count": 0}))  # fmt: skip
    assert client.checkpoints.list_files("empty") == []
    server.route("GET", "/v1/loops/checkpoints/loop/files",
                 lambda r: Reply(200, {"presigned_urls": [_file(0)], "next_page_token": int(r.query["page_token"][0]) + 1,
                                       "total_count": 10**6}))  # fmt: skip
    assert len(client.checkpoints.list_files("loop", max_pages=3)) == 3


def test_checkpoint_source_validate_deploy(server, client):
    server.route("GET", "/v1/loops/checkpoints/ck/source", lambda r: Reply(200, {"source": {"kind": "s3"}}))
    server.route("POST", "/v1/loops/checkpoints/validate", lambda r: Reply(200, {}))
    server.script("POST", "/v1/loops/checkpoints/deploy", Reply(502))
    server.route("POST", "/v1/loops/checkpoints/deploy", lambda r: Reply(200, {"model_id": "m", "deployment_id": "d"}))
    assert client.checkpoints.get_source("ck").kind == "s3"
    client.checkpoints.validate("bt://loops:r/sampler_weights/x", run_id="r")
    assert last(server).json == {"checkpoint_path": "bt://loops:r/sampler_weights/x", "run_id": "r"}
    with pytest.raises(ServerError):  # not idempotent: a 502 is never re-sent
        client.checkpoints.deploy(["ck"], model_name="m", instance_type_id="H100")
    assert client.checkpoints.deploy(["ck"], model_name="m", instance_type_id="H100", hf_secret_name="hf").model_id == "m"
    assert last(server).json == {"checkpoint_ids": ["ck"], "model_name": "m", "instance_type_id": "H100", "hf_secret_name": "hf"}


def test_deployments(server, client):
    server.route("GET", "/v1/loops/deployments", lambda r: Reply(200, {"deployments": [DEPLOYMENT]}))
    server.route("GET", "/v1/loops/deployments/trnr_xyz", lambda r: Reply(200, {"deployment": DEPLOYMENT}))
    server.route("POST", "/v1/loops/deployments/trnr_xyz/deactivate", lambda r: Reply(200, {"id": "trnr_xyz"}))
    server.route("GET", "/v1/loops/deployments/trnr_xyz/logs",
                 lambda r: Reply(200, {"logs": [{"timestamp": "1", "message": "m"}]}))  # fmt: skip
    server.route("POST", "/v1/loops/deployments/trnr_xyz/metrics", lambda r: Reply(200, {"deployment_id": "trnr_xyz", "metrics": {}}))
    assert client.deployments.list(scope="org")[0].is_live
    assert client.deployments.get("trnr_xyz").instance_type.gpu_count == 1
    client.deployments.deactivate("trnr_xyz")
    logs = client.deployments.logs("trnr_xyz", start_epoch_millis=1, end_epoch_millis=2, direction="asc", limit=10, min_level="info")
    assert logs[0].message == "m"
    assert last(server).query == {"start_epoch_millis": ["1"], "end_epoch_millis": ["2"], "direction": ["asc"],
                                  "limit": ["10"], "min_level": ["INFO"]}  # fmt: skip
    with pytest.raises(UsageError):
        client.deployments.logs("trnr_xyz", limit=5000)
    client.deployments.metrics("trnr_xyz", start_epoch_millis=5, step_seconds=60)
    assert last(server).json == {"start_epoch_millis": 5, "step_seconds": 60}


def test_capabilities_user_config_teams_models(server, client):
    server.route("GET", "/v1/loops/capabilities", lambda r: Reply(200, {"supported_models": [{"model_name": "m", "max_seq_len": 8}]}))
    server.route("GET", "/v1/loops/user_config", lambda r: Reply(200, {"user_config": {"trainer_accelerator_priority": None}}))
    server.route("PATCH", "/v1/loops/user_config", lambda r: Reply(200, {"user_config": r.json}))
    server.route("GET", "/v1/teams", lambda r: Reply(200, {"teams": [{"id": "t1", "name": "Research"}, {"id": "t2", "name": "Ops"}]}))
    server.route("GET", "/v1/models/wnpkzp03/deployments/qrpg2r0", lambda r: Reply(200, {"id": "qrpg2r0", "status": "SCALED_TO_ZERO"}))
    assert client.capabilities(model="m", use_case="sft", max_seq_len=8)[0].model_name == "m"
    assert last(server).query == {"model": ["m"], "use_case": ["sft"], "max_seq_len": ["8"]}
    assert client.user_config.get().trainer_accelerator_priority is None
    cfg = client.user_config.patch({"sampler_accelerator_priority": ["H100"], "trainer_accelerator_priority": None})
    assert last(server).json == {"sampler_accelerator_priority": ["H100"], "trainer_accelerator_priority": None}
    assert cfg.sampler_accelerator_priority == ["H100"]
    with pytest.raises(UsageError):
        client.user_config.patch({"sampler_accelerator_priority": []})
    assert client.teams.resolve("research").id == "t1" and client.teams.resolve("t2").name == "Ops"
    with pytest.raises(UsageError):
        client.teams.resolve("nope")
    md = client.model_deployment("wnpkzp03", "qrpg2r0")
    assert md.status_name == "SCALED_TO_ZERO" and not md.is_ready


def test_ids_are_url_encoded(server, client):
    server.route("GET", "/v1/loops/runs/*", lambda r: Reply(200, {"run": RUN}))
    client.runs.get("a/b c")
    assert last(server).path == "/v1/loops/runs/a%2Fb%20c"


def test_create_trainer_request_model(server, client):
    server.route("POST", "/v1/loops/trainers", lambda r: Reply(200, {"run": RUN}))
    client.runs.create_trainer(CreateTrainerRequest(session_id="s", base_model="b", availability_model="spot", replicas=2))
    assert last(server).json == {"session_id": "s", "base_model": "b", "availability_model": "spot", "replicas": 2}
