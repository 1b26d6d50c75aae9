"""The local backend over real HTTP: a real server subprocess, real engine, no mocks.

Most tests share the session-wide ``local_server``; the lifecycle tests (long-poll 408,
restart recovery, crash recovery) use their own server because they stop it or need a
short poll hold.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import LocalServer

from tests.support import cli_env, ctrl_c_as_a_terminal_sends, kill, pull_events, wait_for

pytest.importorskip("torch")

MODEL = "loops-local/tiny"


# ── helpers ──────────────────────────────────────────────────────────────────────────


def datum(tokens: list[int], **extra_inputs: dict) -> dict:
    """A cross-entropy datum: inputs tokens[:-1], targets tokens[1:]."""
    n = len(tokens) - 1
    inputs = {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
              "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]}}
    inputs.update(extra_inputs)
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": inputs}


DATA = [datum([1, 5, 9, 13, 17, 21]), datum([2, 4, 6, 8])]


def rl_datum(tokens: list[int], advantages: list[Any]) -> dict:
    n = len(tokens) - 1
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
                "logprobs": {"data": [-1.0] * n, "dtype": "float32", "shape": [n]},
                "advantages": {"data": advantages, "dtype": "float32", "shape": [n]}}}


def raw_get(base_url: str, path: str) -> tuple[int, bytes]:
    """GET ``path`` byte for byte (no client-side URL normalization)."""
    url = httpx.URL(base_url)
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Trainer:
    """A thin driver of one run's trainer endpoint (what the SDK does, spelled out)."""

    def __init__(self, client: httpx.Client, run: dict) -> None:
        self.client = client
        self.run = run
        self.path = "/trainers/" + run["id"]

    def submit(self, op: str, body: dict | None = None, key: str | None = None) -> httpx.Response:
        return self.client.post(f"{self.path}/{op}", json={"model": self.run["base_model"],
                                                            **(body or {})},
                                headers={"Idempotency-Key": key or uuid.uuid4().hex})

    def poll(self, op_id: str) -> httpx.Response:
        return self.client.get(f"{self.path}/operations/{op_id}")

    def result(self, op_id: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            resp = self.poll(op_id)
            if resp.status_code != 408:
                assert resp.status_code == 200, resp.text
                return resp.json()
        raise AssertionError(f"operation {op_id} still pending after {timeout}s")

    def do(self, op: str, body: dict | None = None) -> dict:
        resp = self.submit(op, body)
        assert resp.status_code == 202, resp.text
        out = self.result(resp.json()["operation_id"])
        assert out["status"] == "done", out
        return out["result"]

    def policy_version(self) -> int:
        return self.client.get(f"{self.path}/policy_version").json()["policy_version"]


def new_session(client: httpx.Client) -> str:
    resp = client.post("/v1/loops/sessions")
    assert resp.status_code == 200, resp.text
    return resp.json()["session"]["id"]


def new_run(client: httpx.Client, *, route: str = "/v1/loops/trainers", **fields) -> Trainer:
    body = {"session_id": new_session(client), "base_model": MODEL, "lora_rank": 4, **fields}
    resp = client.post(route, json=body)
    assert resp.status_code == 200, resp.text
    run = resp.json()["run"]
    wait_healthy(client, run["id"])
    return Trainer(client, run)


def wait_healthy(client: httpx.Client, run_id: str, timeout: float = 120) -> None:
    """Poll the trainer's /health like the SDK does (the first trainer imports torch); until
    it is up, every answer is 503 TrainerStarting."""

    def healthy() -> bool:
        health = client.get(f"/trainers/{run_id}/health", params={"base_model": MODEL})
        if health.status_code != 200:
            assert_error(health, 503, "TrainerStarting")
        return health.status_code == 200

    wait_for(healthy, timeout=timeout, interval=0.05, what=f"trainer {run_id} to be healthy")


def job_running(client: httpx.Client, prefix: str) -> bool:
    """Whether a compute lane runs a job whose label starts with ``prefix`` (``"<op> <run>"``):
    the server's own account, so a test waits for it instead of sleeping."""
    return any((job or "").startswith(prefix) for m in client.get("/v1/local/status").json()["models"]
               for job in m["current_jobs"])


def assert_error(resp: httpx.Response, status: int, error_class: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert isinstance(body.get("detail"), str) and body["detail"], body
    assert isinstance(body.get("error_class"), str), body
    if error_class is not None:
        assert body["error_class"] == error_class, body
    if status == 400:  # the marker that stops the SDK from retrying a hopeless request
        assert body.get("type") == "BadRequestError", body
    return body


@pytest.fixture(scope="module")
def client(local_server: LocalServer):
    with local_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def trained(client: httpx.Client) -> Trainer:
    """A run with two optimizer steps, a trainer checkpoint and a published adapter."""
    trainer = new_run(client)
    for _ in range(2):
        trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        trainer.do("optim_step", {"adam_params": {"learning_rate": 0.05}})
    trainer.do("save_state", {"name": "step-2"})
    trainer.do("save_weights_for_sampler", {"name": "default", "bump_version": True})
    return trainer


# ── auth, health, basics ─────────────────────────────────────────────────────────────


def test_health_needs_no_token_but_everything_else_does(local_server: LocalServer):
    assert httpx.get(local_server.url + "/health").json()["status"] == "ok"
    assert_error(httpx.get(local_server.url + "/v1/loops/runs"), 401, "AuthenticationRequired")
    assert_error(httpx.get(local_server.url + "/v1/loops/runs",
                           headers={"Authorization": "Api-Key nope"}), 401, "InvalidApiKey")
    assert_error(httpx.get(local_server.url + "/trainers/x/health",
                           headers={"Authorization": "Basic abc"}), 401)
    for scheme in ("Api-Key", "Bearer"):
        resp = httpx.get(local_server.url + "/v1/loops/runs",
                         headers={"Authorization": f"{scheme} {local_server.token}"})
        assert resp.status_code == 200, resp.text
    token_file = local_server.state_dir / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600


def test_unknown_route_and_method_are_json(client: httpx.Client):
    assert_error(client.get("/v1/loops/nope"), 404, "RouteNotFound")
    assert_error(client.delete("/v1/loops/runs"), 405, "MethodNotAllowed")


def test_sessions_teams_capabilities_user_config(client: httpx.Client):
    session = new_session(client)
    assert client.get(f"/v1/loops/sessions/{session}").json() == {"session": {"id": session}}
    assert_error(client.get("/v1/loops/sessions/zzzzzzz"), 404)
    with_body = client.post("/v1/loops/sessions", json={"training_project_id": "p1"})
    assert with_body.status_code == 200
    teams = client.get("/v1/teams").json()["teams"]
    team = teams[0]["id"]
    assert client.post(f"/v1/teams/{team}/loops/sessions").status_code == 200
    assert_error(client.post("/v1/teams/nosuchteam/loops/sessions"), 404, "TeamNotFound")

    caps = client.get("/v1/loops/capabilities").json()["supported_models"]
    tiny = next(m for m in caps if m["model_name"] == MODEL)
    assert tiny["enabled"] and tiny["max_seq_len"] > 0
    assert client.get("/v1/loops/capabilities", params={"model": MODEL}).json()[
        "supported_models"][0]["model_name"] == MODEL
    too_long = client.get("/v1/loops/capabilities",
                          params={"model": MODEL, "max_seq_len": tiny["max_seq_len"] + 1}).json()
    assert too_long["supported_models"][0]["enabled"] is False
    assert_error(client.get("/v1/loops/capabilities", params={"use_case": "pretrain"}), 400)

    assert client.get("/v1/loops/user_config").json()["user_config"] == {
        "trainer_accelerator_priority": None, "sampler_accelerator_priority": None}
    set_ = client.patch("/v1/loops/user_config", json={"trainer_accelerator_priority": ["H100"]})
    assert set_.json()["user_config"]["trainer_accelerator_priority"] == ["H100"]
    keep = client.patch("/v1/loops/user_config", json={"sampler_accelerator_priority": ["H200"]})
    assert keep.json()["user_config"] == {"trainer_accelerator_priority": ["H100"],
                                          "sampler_accelerator_priority": ["H200"]}
    assert_error(client.patch("/v1/loops/user_config",
                              json={"trainer_accelerator_priority": []}), 400)
    cleared = client.patch("/v1/loops/user_config", json={"trainer_accelerator_priority": None})
    assert cleared.json()["user_config"]["trainer_accelerator_priority"] is None


# ── runs and the trainer protocol ────────────────────────────────────────────────────


def test_create_run_rejects_bad_requests(client: httpx.Client):
    session = new_session(client)
    body = assert_error(client.post("/v1/loops/trainers",
                                    json={"session_id": session, "base_model": "nope/model"}),
                        400, "UnknownBaseModel")
    assert MODEL in body["detail"]  # lists what is available
    max_len = client.get("/v1/loops/capabilities").json()["supported_models"][0]["max_seq_len"]
    assert_error(client.post("/v1/loops/trainers", json={
        "session_id": session, "base_model": MODEL, "max_seq_len": 10 ** 9}), 400,
        "SequenceTooLong")
    assert_error(client.post("/v1/loops/trainers", json={
        "session_id": session, "base_model": MODEL, "lora_rank": 0}), 400, "ValidationError")
    assert_error(client.post("/v1/loops/trainers", json={
        "session_id": "nosession", "base_model": MODEL}), 400, "SessionNotFound")
    assert_error(client.post("/v1/loops/trainers", content=b"{not json"), 400, "InvalidJson")
    assert max_len > 0


def test_runs_listing_and_paired_sampler(client: httpx.Client):
    trainer = new_run(client, route="/v1/loops/runs", name="paired")  # run + paired sampler
    run = client.get(f"/v1/loops/runs/{trainer.run['id']}").json()["run"]
    assert run["status"] == {"name": "ACTIVE"} and run["name"] == "paired"
    assert run["sampler"]["base_url"].endswith(f"/samplers/{run['sampler']['id']}/sync")
    assert run["deployment_id"] and run["base_url"].endswith(f"/trainers/{run['id']}")
    listed = client.get("/v1/loops/runs", params={"run_id": run["id"]}).json()["runs"]
    assert [r["id"] for r in listed] == [run["id"]]
    assert run["id"] in [r["id"] for r in client.get(
        "/v1/loops/runs", params={"base_model": MODEL}).json()["runs"]]
    team = client.get("/v1/teams").json()["teams"][0]["id"]
    assert client.get(f"/v1/teams/{team}/loops/runs").status_code == 200
    assert_error(client.get("/v1/loops/runs/nosuchrun"), 404)
    # POST /samplers with run_id is idempotent per run: the same paired sampler comes back.
    again = client.post("/v1/loops/samplers", json={"session_id": run["session_id"],
                                                    "run_id": run["id"]}).json()["sampler"]
    assert again["id"] == run["sampler"]["id"]


def test_team_and_debug_route_twins(client: httpx.Client):
    team = client.get("/v1/teams").json()["teams"][0]["id"]
    session = client.post(f"/v1/teams/{team}/loops/sessions").json()["session"]["id"]
    body = {"session_id": session, "base_model": MODEL, "lora_rank": 4}
    made = {}
    for route in (f"/v1/teams/{team}/loops/runs", f"/v1/teams/{team}/loops/trainers",
                  "/v1/loops/debug/trainers", f"/v1/teams/{team}/loops/debug/trainers"):
        resp = client.post(route, json={**body, "scope": "deployment", "debug_version": "x"})
        assert resp.status_code == 200, (route, resp.text)
        made[route] = resp.json()["run"]
    assert made[f"/v1/teams/{team}/loops/runs"]["sampler"] is not None  # /runs pairs one
    assert made[f"/v1/teams/{team}/loops/trainers"]["sampler"] is None
    team_runs = {r["id"] for r in client.get(f"/v1/teams/{team}/loops/runs").json()["runs"]}
    assert {made[f"/v1/teams/{team}/loops/runs"]["id"]} <= team_runs
    samplers = {}
    for route in (f"/v1/teams/{team}/loops/samplers", "/v1/loops/debug/samplers"):
        resp = client.post(route, json={"session_id": session, "base_model": MODEL})
        assert resp.status_code == 200, (route, resp.text)
        samplers[route] = resp.json()["sampler"]["id"]
        health = client.get(f"/samplers/{samplers[route]}/sync/health")
        assert health.json() == {"status": "ACTIVE"}
    team_samplers = {s["id"] for s in client.get(
        f"/v1/teams/{team}/loops/samplers").json()["samplers"]}
    assert samplers[f"/v1/teams/{team}/loops/samplers"] in team_samplers
    for run in made.values():  # leave nothing loaded for the other tests
        client.post(f"/v1/loops/runs/{run['id']}/deactivate")


def test_training_ops_and_policy_version(client: httpx.Client):
    trainer = new_run(client, seed=0)  # a seeded adapter: the loss curve is reproducible
    assert trainer.policy_version() == 0
    init = trainer.do("init_trainer_server", {"lora_rank": 4, "base_model": MODEL})
    assert init == {"step": 0, "lora_rank": 4}
    fwd = trainer.do("forward", {"data": DATA, "loss_fn": "cross_entropy"})
    assert len(fwd["loss_fn_outputs"]) == 2
    lp = fwd["loss_fn_outputs"][0]["logprobs"]
    assert lp["shape"] == [5] and len(lp["data"]) == 5
    losses = []
    for step in range(1, 4):
        fb = trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        losses.append(fb["loss"] if "loss" in fb else fb["metrics"]["loss"])
        opt = trainer.do("optim_step", {"adam_params": {"learning_rate": 0.003}})
        assert opt["metrics"]["grad_norm"] > 0
        assert trainer.policy_version() == step
    assert losses[-1] < losses[0], losses
    # The server half of the SDK's forward_backward_custom: an unnormalized CE it can steer.
    custom = trainer.do("forward", {"data": DATA, "loss_fn": "cross_entropy", "top_k_logprobs": 3,
                                    "loss_fn_config": {"skip_token_normalization": True}})
    assert custom["metrics"]["skip_token_normalization"] == 1.0
    assert custom["loss_fn_outputs"][0]["top_k_logprobs"]["shape"] == [5, 3]
    saved = trainer.do("save_weights_for_sampler", {"name": "pub", "bump_version": False})
    assert saved == {"version": 3, "path": f"bt://loops:{trainer.run['id']}/sampler_weights/pub"}
    rl = trainer.do("forward_backward", {"data": [rl_datum([1, 2, 3, 4], [0.5, -0.5, 1.0])],
                                         "loss_fn": "ppo",
                                         "loss_fn_config": {"clip_low_threshold": 0.9}})
    assert rl["loss_fn_outputs"]


def test_idempotent_submit_applies_once(client: httpx.Client):
    trainer = new_run(client)
    trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
    key = uuid.uuid4().hex
    first = trainer.submit("optim_step", {"adam_params": {}}, key=key)
    second = trainer.submit("optim_step", {"adam_params": {}}, key=key)  # a retried submit
    assert first.status_code == second.status_code == 202
    assert first.json()["operation_id"] == second.json()["operation_id"] == key
    assert first.headers["location"].endswith(f"/operations/{key}")
    assert trainer.result(key)["status"] == "done"
    assert trainer.submit("optim_step", {}, key=key).json()["operation_id"] == key
    assert trainer.policy_version() == 1  # applied once
    assert_error(trainer.submit("forward", {"data": DATA}, key=key), 409, "IdempotencyKeyReused")
    # Retries racing each other (a lost response, resent while the first is in flight).
    trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
    racing = uuid.uuid4().hex
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ids = set(pool.map(lambda _: trainer.submit("optim_step", {}, key=racing).json()[
            "operation_id"], range(4)))
    assert ids == {racing} and trainer.result(racing)["status"] == "done"
    assert trainer.policy_version() == 2


def test_ops_of_a_run_execute_in_submission_order(client: httpx.Client):
    trainer = new_run(client)
    plan = []
    for i in range(3):  # pipelined: nothing is awaited until everything is submitted
        plan.append(("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"}))
        plan.append(("optim_step", {"adam_params": {"learning_rate": 0.01}}))
        plan.append(("save_weights_for_sampler", {"name": f"v{i + 1}"}))
    ids = []
    for seq_id, (op, body) in enumerate(plan, start=1):
        resp = trainer.submit(op, {**body, "seq_id": seq_id})
        assert resp.status_code == 202
        ids.append(resp.json()["operation_id"])
    results = [trainer.result(op_id) for op_id in ids]
    assert all(r["status"] == "done" for r in results)
    versions = [r["result"]["version"] for (op, _), r in zip(plan, results)
                if op == "save_weights_for_sampler"]
    assert versions == [1, 2, 3]  # each save saw exactly the optim steps submitted before it
    logs = client.get(f"/v1/loops/deployments/{trainer.run['deployment_id']}/logs",
                      params={"direction": "asc"}).json()["logs"]
    executed = [line["request_id"] for line in logs if line["request_id"] in ids]
    assert executed == ids


def test_server_stays_responsive_during_compute(client: httpx.Client):
    trainer = new_run(client)
    run_id = trainer.run["id"]
    # The job holds the model's compute thread for longer than the test server's long-poll
    # hold (2 s), so the order of answers proves responsiveness without timing anything.
    client.post("/v1/local/faults", json={"job": f"forward_backward {run_id}", "delay_s": 6})
    slow = trainer.submit("forward_backward", {"data": DATA}).json()["operation_id"]
    wait_for(lambda: job_running(client, f"forward_backward {run_id}"), interval=0.05,
             what="the held job to occupy the model's compute thread")
    for path in ("/v1/loops/runs", f"{trainer.path}/health", "/v1/local/status"):
        assert client.get(path).status_code == 200, path
    # The long-poll ends at its hold with 408 while the job still runs: the requests above
    # were answered during the compute, and the poll did not wait for the job either.
    assert trainer.poll(slow).status_code == 408
    assert trainer.result(slow)["status"] == "done"


def test_sampling_runs_while_a_trainer_job_holds_the_compute_thread(client: httpx.Client):
    """The sampler has its own thread (on the base model's twin): async RL samples the next
    batch while the trainer steps. Proven by order, not time: a sample is answered while a
    held forward_backward is still running."""
    trainer = new_run(client)
    run = trainer.run
    sampler = client.post("/v1/loops/samplers", json={"session_id": run["session_id"],
                                                      "run_id": run["id"]}).json()["sampler"]
    base = sampler["base_url"].replace(client.base_url.__str__().rstrip("/"), "")
    body = {"prompt": [1, 5, 9], "n": 2, "max_tokens": 4, "temperature": 0.0}
    assert client.post(f"{base}/sample", json=body).status_code == 200  # loaded, warm
    client.post("/v1/local/faults", json={"job": f"forward_backward {run['id']}", "delay_s": 30})
    slow = trainer.submit("forward_backward", {"data": DATA}).json()["operation_id"]
    wait_for(lambda: job_running(client, "forward_backward"), timeout=60, interval=0.05, what="the held job to start")
    answer = client.post(f"{base}/sample", json=body, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 2, answer.text
    still = [m["current_jobs"] for m in client.get("/v1/local/status").json()["models"]]
    assert any(any(j.startswith("forward_backward") for j in jobs) for jobs in still), still
    client.delete("/v1/local/faults")
    assert trainer.result(slow, timeout=120)["status"] == "done"


def test_operation_results_expire_but_keys_still_dedupe(tmp_path: Path):
    """Retention, checked on the registry itself (an hour is too long to wait over HTTP)."""
    import asyncio

    from baseten_loops_cli.local.server.operations import OperationRegistry
    from baseten_loops_cli.local.store import OP_EXPIRED, Store

    async def scenario() -> None:
        store = Store(tmp_path / "ops.db")
        ops = OperationRegistry(store, result_ttl_s=3600, idempotency_window_s=86400)
        ops.create("run1", "optim_step", "key-1", 1)
        ops.finish("run1", "key-1", result={"metrics": {}})
        ops.expire(time.time() + 3601)  # an hour later: result gone, record kept
        row = ops.find("run1", "key-1")
        assert row is not None and row.status == OP_EXPIRED and row.result is None
        ops.expire(time.time() + 86401)  # a day later: forgotten entirely
        assert ops.find("run1", "key-1") is None
        store.close()

    asyncio.run(scenario())


def test_bad_inputs_are_400s_and_the_server_keeps_going(client: httpx.Client,
                                                        local_server: LocalServer):
    trainer = new_run(client, max_seq_len=16)
    cases = {
        "SequenceTooLong": {"data": [datum(list(range(1, 20)))]},
        "ShapeMismatch": {"data": [{**datum([1, 2, 3]), "loss_fn_inputs": {
            "target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [3]}}}]},
        "DtypeMismatch": {"data": [{**datum([1, 2, 3]), "loss_fn_inputs": {
            "target_tokens": {"data": [2.0, 3.0], "dtype": "float32", "shape": [2]}}}]},
        "UnknownLoss": {"data": DATA, "loss_fn": "hinge"},
        "UnknownLossConfigKey": {"data": DATA, "loss_fn": "cross_entropy",
                                 "loss_fn_config": {"kl_beta": 0.1}},
        "NaNInput": {"data": [rl_datum([1, 2, 3], [1.0, None])], "loss_fn": "ppo"},
        "MissingLossInput": {"data": DATA, "loss_fn": "importance_sampling"},
        "InvalidDatum": {"data": []},
    }
    for error_class, body in cases.items():
        resp = trainer.submit("forward_backward", body)
        assert_error(resp, 400, error_class)
    assert_error(trainer.submit("optim_step", {"adam_params": {"learning_rate": "fast"}}), 400,
                 "InvalidAdamParams")
    assert_error(trainer.submit("save_state", {"name": "../escape"}), 400, "InvalidCheckpointName")
    assert_error(trainer.submit("no_such_op"), 404)
    assert_error(client.post(f"{trainer.path}/forward", content=b"[1,"), 400, "InvalidJson")
    # An op whose problem only shows at run time fails as an op error, not a hang.
    missing = trainer.submit("load_state", {"path": f"bt://loops:{trainer.run['id']}/weights/x"})
    failed = trainer.result(missing.json()["operation_id"])
    assert failed["status"] == "error" and failed["error_class"] == "CheckpointNotFound"
    # Nothing above hurt the run or the server.
    trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
    assert httpx.get(local_server.url + "/health").status_code == 200


def test_deactivated_run_refuses_ops(client: httpx.Client):
    trainer = new_run(client)
    resp = client.post(f"/v1/loops/runs/{trainer.run['id']}/deactivate")
    assert resp.json()["id"] == trainer.run["id"] and "user" in resp.json()
    assert client.get(f"/v1/loops/runs/{trainer.run['id']}").json()["run"]["status"] == {
        "name": "INACTIVE"}
    dep = client.get(f"/v1/loops/deployments/{trainer.run['deployment_id']}").json()
    assert dep["deployment"]["status"] == {"name": "STOPPED"}
    assert_error(trainer.submit("forward", {"data": DATA}), 409, "RunInactive")
    assert_error(client.get(f"{trainer.path}/health"), 409, "RunInactive")
    assert client.post(f"/v1/loops/runs/{trainer.run['id']}/deactivate").status_code == 200


# ── checkpoints and files ────────────────────────────────────────────────────────────


def test_checkpoint_listing_rules(client: httpx.Client, trained: Trainer):
    run_id = trained.run["id"]
    assert_error(client.get("/v1/loops/checkpoints"), 400, "InvalidQuery")
    assert_error(client.get("/v1/loops/checkpoints",
                            params={"run_id": run_id, "base_model": MODEL}), 400, "InvalidQuery")
    cps = client.get("/v1/loops/checkpoints", params={"run_id": run_id}).json()["checkpoints"]
    assert [(c["checkpoint_id"], c["target"]) for c in cps] == [("default", "sampler"),
                                                                ("step-2", "trainer")]
    created = [c["created_at"] for c in cps]
    assert created == sorted(created, reverse=True)  # newest first
    assert cps[0]["lora_adapter_config"]["r"] == 4 and cps[0]["size_bytes"] > 0
    by_model = client.get("/v1/loops/checkpoints", params={"base_model": MODEL}).json()
    assert {c["id"] for c in cps} <= {c["id"] for c in by_model["checkpoints"]}
    by_path = client.get("/v1/loops/checkpoints", params={
        "checkpoint_path": f"bt://loops:{run_id}/weights/step-2"}).json()["checkpoints"]
    assert [c["checkpoint_id"] for c in by_path] == ["step-2"]
    assert client.get("/v1/loops/checkpoints", params={
        "checkpoint_path": f"bt://loops:{run_id}/weights/nope"}).json() == {"checkpoints": []}
    assert client.get(f"/v1/loops/checkpoints/{cps[0]['id']}/source").json()["source"][
        "kind"] == "s3"
    ok = client.post("/v1/loops/checkpoints/validate", json={
        "checkpoint_path": f"bt://loops:{run_id}/sampler_weights/default", "run_id": run_id})
    assert ok.status_code == 200 and ok.json() == {}
    assert_error(client.post("/v1/loops/checkpoints/validate", json={
        "checkpoint_path": f"bt://loops:{run_id}/weights/step-2"}), 400, "WrongCheckpointTarget")
    assert_error(client.post("/v1/loops/checkpoints/validate", json={
        "checkpoint_path": f"bt://loops:{run_id}/sampler_weights/nope"}), 404)


def _files(client: httpx.Client, pk: str, **params) -> dict:
    resp = client.get(f"/v1/loops/checkpoints/{pk}/files", params=params)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_presigned_files_paging_range_expiry_tampering(client: httpx.Client, trained: Trainer,
                                                       local_server: LocalServer):
    cps = client.get("/v1/loops/checkpoints", params={"run_id": trained.run["id"]}).json()
    pk = next(c["id"] for c in cps["checkpoints"] if c["target"] == "sampler")
    everything = _files(client, pk)
    total = everything["total_count"]
    assert total == len(everything["presigned_urls"]) >= 1 and everything["next_page_token"] is None
    names = [f["relative_file_name"] for f in everything["presigned_urls"]]
    assert any(n.endswith(".safetensors") for n in names), names
    paged, token = [], 0
    while token is not None:
        page = _files(client, pk, page_size=1, page_token=token)
        assert page["total_count"] == total and len(page["presigned_urls"]) <= 1
        paged += [f["relative_file_name"] for f in page["presigned_urls"]]
        token = page["next_page_token"]
    assert paged == names
    assert_error(client.get(f"/v1/loops/checkpoints/{pk}/files", params={"page_size": 0}), 400)
    assert_error(client.get("/v1/loops/checkpoints/NOPE1234/files"), 404)

    entry = max(everything["presigned_urls"], key=lambda f: f["size_bytes"])
    url = entry["url"]
    full = httpx.get(url)  # no auth header: the link is the credential
    assert full.status_code == 200 and len(full.content) == entry["size_bytes"]
    digest = hashlib.sha256(full.content).hexdigest()  # so a downloader can verify
    assert entry["sha256"] == full.headers["x-checksum-sha256"] == digest
    assert full.headers["etag"] == f'"{digest}"'
    part = httpx.get(url, headers={"Range": "bytes=2-9"})
    assert part.status_code == 206 and part.content == full.content[2:10]
    resumed = httpx.get(url, headers={"Range": "bytes=2-9", "If-Range": f'"{digest}"'})
    assert resumed.status_code == 206
    changed = httpx.get(url, headers={"Range": "bytes=2-9", "If-Range": '"stale"'})
    assert changed.status_code == 200 and changed.content == full.content
    assert part.headers["content-range"] == f"bytes 2-9/{entry['size_bytes']}"
    tail = httpx.get(url, headers={"Range": "bytes=-4"})
    assert tail.status_code == 206 and tail.content == full.content[-4:]
    assert_error(httpx.get(url, headers={"Range": f"bytes={entry['size_bytes'] + 5}-"}), 416)

    base, query = url.split("?")
    params = dict(p.split("=") for p in query.split("&"))
    assert_error(httpx.get(f"{base}?expires={params['expires']}&sig={'0' * 64}"), 403,
                 "SignatureInvalid")
    assert_error(httpx.get(f"{base}?expires={int(params['expires']) + 60}&sig={params['sig']}"),
                 403, "SignatureInvalid")
    assert_error(httpx.get(base), 403, "SignatureMissing")
    other = next(n for n in names if n != entry["relative_file_name"]) if len(names) > 1 else None
    if other:  # a signature is scoped to one file
        assert_error(httpx.get(base.rsplit("/", 1)[0] + f"/{other}?{query}"), 403)
    # An expired link: sign with the server's own secret, in the past.
    secret = (local_server.data_dir / "presign.key").read_bytes()
    rel = entry["relative_file_name"]
    expires = int(time.time()) - 10
    sig = hmac.new(secret, f"{pk}\n{rel}\n{expires}".encode(), hashlib.sha256).hexdigest()
    assert_error(httpx.get(f"{local_server.url}/files/{pk}/{rel}?expires={expires}&sig={sig}"),
                 403, "LinkExpired")
    # Traversal: refused whatever the signature (signed with the real secret, even). Sent
    # with http.client, which (unlike httpx) does not normalize the dots away.
    future = expires + 10**6
    for evil, decoded in (("../../loops.db", "../../loops.db"),
                          ("..%2F..%2Floops.db", "../../loops.db"),
                          ("%2e%2e/%2e%2e/presign.key", "../../presign.key")):
        sig = hmac.new(secret, f"{pk}\n{decoded}\n{future}".encode(), hashlib.sha256).hexdigest()
        status, body = raw_get(local_server.url, f"/files/{pk}/{evil}?expires={future}&sig={sig}")
        assert status == 403, (evil, status, body)
        assert json.loads(body)["error_class"] == "PathNotAllowed"


def test_checkpoint_ttl_expires(client: httpx.Client, trained: Trainer):
    trained.do("save_state", {"name": "short-lived", "ttl_seconds": 1})
    path = f"bt://loops:{trained.run['id']}/weights/short-lived"
    assert client.get("/v1/loops/checkpoints", params={"checkpoint_path": path}).json()[
        "checkpoints"]
    wait_for(lambda: not client.get("/v1/loops/checkpoints", params={"checkpoint_path": path}).json()["checkpoints"],
             timeout=10, interval=0.3, what="the TTL'd checkpoint to be deleted")


def test_load_state_round_trip(client: httpx.Client, trained: Trainer):
    trainer = new_run(client)
    path = f"bt://loops:{trained.run['id']}/weights/step-2"
    assert trainer.do("load_state_with_optimizer", {"path": path}) == {"step": 2}
    assert trainer.policy_version() == 2
    assert trainer.do("load_state", {"path": path}) == {"step": 0}
    wrong = trainer.submit("load_state",
                           {"path": f"bt://loops:{trained.run['id']}/sampler_weights/default"})
    assert trainer.result(wrong.json()["operation_id"])["error_class"] == "WrongCheckpointTarget"
    # A run can also start from a checkpoint (what create_training_client_from_state does).
    started = new_run(client, path=path)
    assert started.do("init_trainer_server", {"lora_rank": 4}) == {"step": 0, "lora_rank": 4}
    assert_error(client.post("/v1/loops/trainers", json={
        "session_id": new_session(client), "base_model": MODEL, "lora_rank": 8, "path": path}),
        400, "LoraRankMismatch")


# ── samplers ─────────────────────────────────────────────────────────────────────────


def test_paired_sampler_weight_sync(client: httpx.Client, trained: Trainer):
    run = trained.run
    sampler = client.post("/v1/loops/samplers", json={"session_id": run["session_id"],
                                                      "run_id": run["id"]}).json()["sampler"]
    assert sampler["model_id"] and sampler["deployment_id"]
    status = client.get(f"/v1/models/{sampler['model_id']}/deployments/"
                        f"{sampler['deployment_id']}").json()
    assert status["status"] == "ACTIVE"
    base = sampler["base_url"].replace(client.base_url.__str__().rstrip("/"), "")
    assert client.get(f"{base}/trainers_policy_version").json() == {"policy_version": 2}
    models = client.get(f"{base}/v1/models").json()["data"]
    assert models[0] == {"id": MODEL, "object": "model", "parent": None, "root": MODEL}
    assert models[1]["id"] == "default" and models[1]["parent"] == MODEL

    body = {"prompt": [1, 5, 9], "n": 2, "max_tokens": 5, "temperature": 0.7, "top_p": 1.0,
            "logprobs": 0, "return_tokens_as_token_ids": True, "seed": 3, "prompt_logprobs": 2}
    resp = client.post(f"{base}/sample", json=body, headers={"X-Min-Policy-Version": "2"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-trainers-policy-version"] == "2"
    out = resp.json()
    assert len(out["choices"]) == 2
    for choice in out["choices"]:
        assert 1 <= len(choice["token_ids"]) <= 5
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
        assert choice["finish_reason"] in ("stop", "length")
        assert isinstance(choice["text"], str) and choice["prompt_token_ids"] == [1, 5, 9]
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == 3
        assert str(5) in plp[1] and plp[1][str(5)]["logprob"] <= 0
    again = client.post(f"{base}/sample", json=body).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in out["choices"]]

    behind = client.post(f"{base}/sample", json=body, headers={"X-Min-Policy-Version": "3"})
    assert_error(behind, 408, "PolicyVersionBehind")
    pin = f"bt://loops:{run['id']}/sampler_weights/default"
    pinned = client.post(f"{base}/sample", json=body, headers={
        "X-Min-Policy-Version": "3", "X-Checkpoint-Path": pin})
    assert pinned.status_code == 200 and pinned.headers["x-trainers-policy-version"] == "2"
    assert_error(client.post(f"{base}/sample", json={**body, "prompt": []}), 400)
    assert_error(client.post(f"{base}/sample", json={**body, "max_tokens": 10 ** 7}), 400,
                 "SequenceTooLong")
    assert_error(client.post(f"{base}/sample", json={**body, "prompt": [10 ** 9]}), 400,
                 "InvalidTokenId")
    assert_error(client.post(f"{base}/sample", json=body,
                             headers={"X-Checkpoint-Path": "s3://bucket/x"}), 400)


def test_concurrent_samples_are_batched(client: httpx.Client, local_server: LocalServer):
    session = new_session(client)
    sampler = client.post("/v1/loops/samplers", json={"session_id": session,
                                                      "base_model": MODEL}).json()["sampler"]
    path = f"/samplers/{sampler['id']}/sync/sample"
    body = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0}

    def one(_: int) -> httpx.Response:
        with local_server.client() as c:
            return c.post(path, json=body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    assert all(r.status_code == 200 for r in responses)
    greedy = {tuple(r.json()["choices"][0]["token_ids"]) for r in responses}
    assert len(greedy) == 1  # temperature 0: identical, batched or not
    stats = client.get("/v1/local/status").json()["sampling"][MODEL]
    assert stats["largest_batch"] > 1


def test_requests_arriving_less_than_a_window_apart_go_in_one_batch(server_factory):
    """The batching window restarts with each arrival (samplers.SampleBatcher): the requests
    of an async RL batch reach a server that is training spread out, over more than one window
    in all, and a window counted from the first request split them into two engine calls."""
    server = server_factory(sample_batch_window_s=0.5)
    with server.client() as client:
        session = new_session(client)
        sampler = client.post("/v1/loops/samplers", json={"session_id": session,
                                                          "base_model": MODEL}).json()["sampler"]
        path = f"/samplers/{sampler['id']}/sync/sample"
        body = {"prompt": [3, 4, 5], "max_tokens": 2, "temperature": 0.0}
        assert client.post(path, json=body).status_code == 200  # the engine and the model loaded
        before = client.get("/v1/local/status").json()["sampling"][MODEL]["batches"]

        def one(i: int) -> httpx.Response:
            time.sleep(0.1 * i)  # 8 requests over 0.7 s, 0.1 s apart
            with server.client() as c:
                return c.post(path, json=body)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(one, range(8)))
        assert all(r.status_code == 200 for r in responses)
        stats = client.get("/v1/local/status").json()["sampling"][MODEL]
        assert (stats["batches"] - before, stats["largest_batch"]) == (1, 8)


def test_standalone_samplers_and_deactivate(client: httpx.Client, trained: Trainer):
    session = new_session(client)
    assert_error(client.post("/v1/loops/samplers", json={"session_id": session}), 400)
    assert_error(client.post("/v1/loops/samplers", json={
        "session_id": session, "base_model": MODEL, "run_id": trained.run["id"]}), 400)
    path = f"bt://loops:{trained.run['id']}/sampler_weights/default"
    from_ckpt = client.post("/v1/loops/samplers", json={"session_id": session,
                                                        "model_path": path}).json()["sampler"]
    assert from_ckpt["model_path"] == path and from_ckpt["policy_version"] == 2
    resp = client.post(f"/samplers/{from_ckpt['id']}/sync/sample",
                       json={"prompt": [1, 2], "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-trainers-policy-version"] == "2"
    assert from_ckpt["id"] in [s["id"] for s in client.get("/v1/loops/samplers").json()["samplers"]]
    assert client.get(f"/v1/loops/samplers/{from_ckpt['id']}").json()["sampler"]["id"] == \
        from_ckpt["id"]
    assert_error(client.post("/v1/loops/samplers", json={
        "session_id": session, "model_path": f"bt://loops:{trained.run['id']}/weights/step-2"}),
        400, "WrongCheckpointTarget")
    gone = client.post(f"/v1/loops/samplers/{from_ckpt['id']}/deactivate").json()
    assert gone["id"] == from_ckpt["id"]
    assert_error(client.post(f"/samplers/{from_ckpt['id']}/sync/sample",
                             json={"prompt": [1], "max_tokens": 1}), 409, "SamplerInactive")
    status = client.get(f"/v1/models/{from_ckpt['model_id']}/deployments/"
                        f"{from_ckpt['deployment_id']}").json()
    assert status["status"] == "INACTIVE"


# ── scale to zero ────────────────────────────────────────────────────────────────────


def _sampler_adapters(client: httpx.Client) -> list[str]:
    models = client.get("/v1/local/status").json()["models"]
    return [key for m in models for key in m["sampler_adapters_in_memory"]]


def test_a_runs_live_adapter_versions_share_two_engine_slots(client: httpx.Client):
    """Each save_weights_for_sampler of an RL run republishes its paired sampler's adapter:
    the engine holds the last two versions (sampler.FAMILY_SLOTS), refilling their layers in
    place, not a slot per version up to its LRU's eight."""
    trainer = new_run(client, route="/v1/loops/runs")
    run_id = trainer.run["id"]
    sampler = client.get(f"/v1/loops/runs/{run_id}").json()["run"]["sampler"]
    for step in range(4):
        trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        trainer.do("optim_step", {"adam_params": {"learning_rate": 0.05}})
        trainer.do("save_weights_for_sampler", {"name": f"v{step}", "bump_version": True})
        sample = client.post(f"/samplers/{sampler['id']}/sync/sample",
                             json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert sample.status_code == 200
        assert sample.headers["x-trainers-policy-version"] == str(step + 1)
    pks = {c["id"] for c in client.get("/v1/loops/checkpoints",
                                        params={"run_id": run_id}).json()["checkpoints"]}
    assert len(pks) == 4
    assert len([key for key in _sampler_adapters(client) if key.split("@")[0] in pks]) == 2


def test_scale_to_zero_and_wake(client: httpx.Client):
    # 2 s: long enough that the checks right after sampling see the adapter loaded.
    trainer = new_run(client, route="/v1/loops/runs", scale_down_delay_seconds=2)
    trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
    trainer.do("optim_step", {"adam_params": {"learning_rate": 0.05}})
    trainer.do("save_weights_for_sampler", {"name": "live", "bump_version": True})
    run_id = trainer.run["id"]
    sampler = client.get(f"/v1/loops/runs/{run_id}").json()["run"]["sampler"]
    sample = client.post(f"/samplers/{sampler['id']}/sync/sample",
                         json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert sample.status_code == 200 and sample.headers["x-trainers-policy-version"] == "1"
    pk = client.get("/v1/loops/checkpoints", params={"run_id": run_id}).json()[
        "checkpoints"][0]["id"]
    assert any(key.startswith(pk) for key in _sampler_adapters(client))
    dep_path = f"/v1/loops/deployments/{trainer.run['deployment_id']}"

    def status() -> str:
        return client.get(dep_path).json()["deployment"]["status"]["name"]

    wait_for(lambda: status() == "SCALED_TO_ZERO", timeout=15)
    assert run_id not in client.get("/v1/local/status").json()["runs_in_memory"]
    wait_for(lambda: client.get(f"/v1/loops/samplers/{sampler['id']}").json()["sampler"][
        "status"]["name"] == "SCALED_TO_ZERO", timeout=15)
    wait_for(lambda: not any(key.startswith(pk) for key in _sampler_adapters(client)), timeout=15)
    deployment = client.get(f"/v1/models/{sampler['model_id']}/deployments/"
                            f"{sampler['deployment_id']}").json()
    assert deployment["status"] == "SCALED_TO_ZERO"
    # The SDK wakes a scaled-to-zero sampler with POST <base without /sync>/wake.
    assert client.post(f"/samplers/{sampler['id']}/wake").json()["status"] == "ACTIVE"
    # The next op wakes the trainer from its saved state: same step, optimizer intact.
    assert trainer.policy_version() == 1
    trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
    assert status() == "RUNNING"
    trainer.do("optim_step", {"adam_params": {"learning_rate": 0.05}})
    assert trainer.policy_version() == 2
    logs = [line["message"] for line in client.get(f"{dep_path}/logs").json()["logs"]]
    assert any("scaled to zero" in m for m in logs) and any("Waking" in m for m in logs)


def test_a_woken_sampler_stays_up_until_the_sdks_next_status_poll(server_factory):
    """The SDK wakes a sampler once (POST /wake), then polls its status every 10 s until
    ACTIVE. With a run's scale_down_delay_seconds under 10 s the sampler was scaled down
    again before the first poll, and ensure_ready waited out its whole timeout. The shipped
    floor covers two polls; the server here has a 4 s floor (the behaviour, without a 12 s
    wait), which holds past the run's 1 s delay and then lets the sampler go."""
    from baseten_loops_cli.local.server.context import ServerConfig

    assert ServerConfig.sampler_min_awake_s >= 20  # two of the SDK's 10 s polls
    floor = 4.0
    server = server_factory(sampler_min_awake_s=floor)
    with server.client() as client:
        run = new_run(client, route="/v1/loops/runs", scale_down_delay_seconds=1).run
        sampler = client.get(f"/v1/loops/runs/{run['id']}").json()["run"]["sampler"]
        assert client.post(f"/samplers/{sampler['id']}/wake").json()["status"] == "ACTIVE"
        woken = time.monotonic()

        def status() -> str:
            return client.get(f"/v1/loops/samplers/{sampler['id']}").json()["sampler"]["status"]["name"]

        time.sleep(max(0.0, woken + 2.5 - time.monotonic()))  # past the run's delay and janitor ticks
        assert status() == "ACTIVE"
        deployment = client.get(f"/v1/models/{sampler['model_id']}/deployments/{sampler['deployment_id']}").json()
        assert deployment["status"] == "ACTIVE", deployment
        # The trainer keeps its own short delay: only samplers wait for a poll.
        dep = client.get(f"/v1/loops/deployments/{run['deployment_id']}").json()["deployment"]
        assert dep["status"]["name"] == "SCALED_TO_ZERO"
        # Past the floor it goes (the floor is a floor, not a pin).
        wait_for(lambda: status() == "SCALED_TO_ZERO", timeout=30, interval=0.2, what="the sampler to scale down")
        assert time.monotonic() - woken >= floor - 0.5  # woken: read just after the server stamped it


# ── trainer deployments, checkpoint deployments ──────────────────────────────────────


def test_trainer_deployment_routes(client: httpx.Client, trained: Trainer):
    deployments = client.get("/v1/loops/deployments").json()["deployments"]
    dep = next(d for d in deployments if d["latest_run_id"] == trained.run["id"])
    assert dep["active_run_id"] == trained.run["id"] and dep["instance_type"]["gpu_count"] == 0
    one = client.get(f"/v1/loops/deployments/{dep['id']}").json()["deployment"]
    assert one["status"]["name"] in ("RUNNING", "SCALED_TO_ZERO")
    logs = client.get(f"/v1/loops/deployments/{dep['id']}/logs",
                      params={"limit": 3, "direction": "asc"}).json()["logs"]
    assert len(logs) == 3 and all(int(line["timestamp"]) > 0 for line in logs)
    assert "Created run" in logs[0]["message"]
    errors_only = client.get(f"/v1/loops/deployments/{dep['id']}/logs",
                             params={"min_level": "ERROR"}).json()["logs"]
    assert all(line["level"] == "ERROR" for line in errors_only)
    assert_error(client.get(f"/v1/loops/deployments/{dep['id']}/logs", params={"limit": 0}), 400)
    assert_error(client.get(f"/v1/loops/deployments/{dep['id']}/logs",
                            params={"start_epoch_millis": 0}), 400)
    metrics = client.post(f"/v1/loops/deployments/{dep['id']}/metrics",
                          json={"step_seconds": 60}).json()
    assert metrics["deployment_id"] == dep["id"]
    assert sum(p["value"] for p in metrics["metrics"]["inference_volume"]) >= 6
    assert client.get(f"/v1/loops/deployments/{dep['id']}/debug_archive/files").json()[
        "presigned_urls"] == []
    assert_error(client.get("/v1/loops/deployments/nope"), 404)


def test_deactivate_through_deployment_route(client: httpx.Client):
    trainer = new_run(client)
    dep_id = trainer.run["deployment_id"]
    assert client.post(f"/v1/loops/deployments/{dep_id}/deactivate").status_code == 200
    assert client.get(f"/v1/loops/runs/{trainer.run['id']}").json()["run"]["status"][
        "name"] == "INACTIVE"


def test_deploy_checkpoint_serves_openai_api(client: httpx.Client, trained: Trainer):
    cps = client.get("/v1/loops/checkpoints", params={"run_id": trained.run["id"]}).json()
    sampler_pk = next(c["id"] for c in cps["checkpoints"] if c["target"] == "sampler")
    trainer_pk = next(c["id"] for c in cps["checkpoints"] if c["target"] == "trainer")
    assert_error(client.post("/v1/loops/checkpoints/deploy", json={
        "checkpoint_ids": [trainer_pk], "model_name": "x"}), 400, "WrongCheckpointTarget")
    assert_error(client.post("/v1/loops/checkpoints/deploy", json={"checkpoint_ids": []}), 400)
    made = client.post("/v1/loops/checkpoints/deploy", json={
        "checkpoint_ids": [sampler_pk], "model_name": "my-model", "instance_type_id": "cpu",
        "hf_secret_name": "hf_access_token"}).json()
    model_id, dep_id = made["model_id"], made["deployment_id"]
    status = client.get(f"/v1/models/{model_id}/deployments/{dep_id}").json()
    assert status["status"] == "ACTIVE" and status["name"] == "my-model"
    base = f"/deployments/{dep_id}/v1"
    # The deployment's model name is served as a model id (issue 26), then each checkpoint by
    # name, then the base model.
    assert [m["id"] for m in client.get(f"{base}/models").json()["data"]] == ["my-model", "default", MODEL]
    chat = client.post(f"{base}/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 0})
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert chat.json()["usage"]["completion_tokens"] >= 1
    comp = client.post(f"{base}/completions", json={"model": MODEL, "prompt": "hello",
                                                    "max_tokens": 3})
    assert comp.status_code == 200 and isinstance(comp.json()["choices"][0]["text"], str)
    stream = client.post(f"{base}/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert_error(client.post(f"{base}/chat/completions", json={
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]}), 404, "ModelNotFound")
    logs = client.post(f"/v1/models/{model_id}/deployments/{dep_id}/logs", json={}).json()
    assert any("Deployed" in line["message"] for line in logs["logs"])
    assert client.post(f"/v1/models/{model_id}/deployments/{dep_id}/deactivate").status_code == 200
    assert_error(client.post(f"{base}/completions", json={"prompt": "x"}), 409)


# ── fault hooks, local status ────────────────────────────────────────────────────────


def test_fault_hooks(client: httpx.Client):
    added = client.post("/v1/local/faults", json={
        "path": "/v1/loops/capabilities", "method": "GET", "times": 2, "status": 503,
        "retry_after": 1})
    assert added.status_code == 200 and added.json()["fault"]["remaining"] == 2
    first = client.get("/v1/loops/capabilities")
    assert first.status_code == 503 and first.headers["retry-after"] == "1"
    assert first.json()["error_class"] == "InjectedFault"
    assert client.get("/v1/loops/capabilities").status_code == 503
    assert client.get("/v1/loops/capabilities").status_code == 200
    client.post("/v1/local/faults", json={"path": "/v1/teams", "delay_s": 0.3})
    started = time.monotonic()
    assert client.get("/v1/teams").status_code == 200
    assert time.monotonic() - started >= 0.3  # a lower bound: load only lengthens it
    client.post("/v1/local/faults", json={"path": "/trainers/*/forward", "status": 502})
    assert len(client.get("/v1/local/faults").json()["faults"]) == 1
    assert client.delete("/v1/local/faults").json() == {"cleared": 1}
    assert_error(client.post("/v1/local/faults", json={"path": "/x"}), 400, "InvalidFault")


def test_local_status_and_usage(client: httpx.Client, trained: Trainer):
    status = client.get("/v1/local/status").json()
    assert status["engine_loaded"] and any(m["model"] == MODEL for m in status["models"])
    usage = client.get("/v1/local/usage", params={"run_id": trained.run["id"]}).json()["usage"]
    assert usage[0]["tokens_trained"] == 2 * (5 + 3) and usage[0]["compute_seconds"] > 0


# ── lifecycle: long-poll, restart and crash recovery (own server) ────────────────────


def test_long_poll_restart_and_crash_recovery(server_factory):
    server = server_factory(op_poll_hold_s=0.3)
    with server.client() as client:
        trainer = new_run(client)
        run_id = trainer.run["id"]
        # Make the next forward_backward of this run take 1.5 s: longer than the poll hold.
        client.post("/v1/local/faults", json={"job": f"forward_backward {run_id}",
                                              "delay_s": 1.5})
        slow = trainer.submit("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        op_id = slow.json()["operation_id"]
        pending = trainer.poll(op_id)
        assert_error(pending, 408, "OperationPending")
        assert pending.json()["status"] in ("pending", "running")
        assert trainer.result(op_id)["status"] == "done"  # 408s, then 200
        assert_error(trainer.poll("never-submitted"), 404, "UnknownOperation")
        trainer.do("optim_step", {"adam_params": {"learning_rate": 0.05}})
        trainer.do("save_state", {"name": "before-restart"})
        saved = trainer.do("save_weights_for_sampler", {"name": "adapter", "bump_version": True})
        cps = client.get("/v1/loops/checkpoints", params={"run_id": run_id}).json()
        pk = next(c["id"] for c in cps["checkpoints"] if c["checkpoint_id"] == "adapter")
        old_links = _files(client, pk)["presigned_urls"]
        # Stop the server while one op runs (slowly) and two more wait behind it.
        client.post("/v1/local/faults", json={"job": f"forward *{run_id}", "delay_s": 1.0})
        in_flight = [trainer.submit("forward", {"data": DATA}).json()["operation_id"]
                     for _ in range(3)]
        wait_for(lambda: job_running(client, f"forward {run_id}"), interval=0.05, what="the first op to run")

    server.restart()
    with server.client() as client:
        trainer.client = client
        outcomes = [trainer.result(op_id, timeout=10) for op_id in in_flight]
        assert outcomes[0]["status"] == "done", outcomes  # the running one finished first
        for outcome in outcomes[1:]:  # the queued ones were refused, clearly
            assert outcome["status"] == "error" and outcome["error_class"] == "ServerShutdown"
        run = client.get(f"/v1/loops/runs/{run_id}").json()["run"]
        assert run["status"]["name"] == "ACTIVE"
        dep = client.get(f"/v1/loops/deployments/{run['deployment_id']}").json()["deployment"]
        assert dep["status"]["name"] == "SCALED_TO_ZERO"
        names = {c["checkpoint_id"] for c in client.get(
            "/v1/loops/checkpoints", params={"run_id": run_id}).json()["checkpoints"]}
        assert {"before-restart", "adapter"} <= names
        for link in old_links:  # links from before the restart still work
            assert httpx.get(link["url"]).status_code == 200
        for link in _files(client, pk)["presigned_urls"]:
            assert len(httpx.get(link["url"]).content) == link["size_bytes"]
        assert trainer.policy_version() == 1 == saved["version"]
        trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        trainer.do("optim_step", {"adam_params": {"learning_rate": 0.05}})
        assert trainer.policy_version() == 2  # woke from its saved state and kept going
        assert client.get(f"/v1/loops/deployments/{run['deployment_id']}").json()[
            "deployment"]["status"]["name"] == "RUNNING"

        # A crash (SIGKILL) with a gradient accumulated and an op mid-flight.
        trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        client.post("/v1/local/faults", json={"job": f"forward *{run_id}", "delay_s": 5})
        crashed = trainer.submit("forward", {"data": DATA}).json()["operation_id"]
        wait_for(lambda: job_running(client, f"forward {run_id}"), interval=0.05, what="the op to run")
    kill(server)
    server.start()
    with server.client() as client:
        trainer.client = client
        outcome = trainer.result(crashed, timeout=10)
        assert outcome["status"] == "error" and outcome["error_class"] == "ServerRestarted"
        assert "resubmit" in outcome["error"].lower()
        # The run's step survives the crash (a snapshot follows every optim_step here)...
        assert trainer.policy_version() == 2
        # ...but the gradient accumulated before the crash is gone, and optim_step says so
        # instead of silently stepping on nothing.
        lost = trainer.submit("optim_step", {"adam_params": {}})
        outcome = trainer.result(lost.json()["operation_id"])
        assert outcome["status"] == "error" and outcome["error_class"] == "GradientsLost"


# ── daemon and CLI ───────────────────────────────────────────────────────────────────


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args],
                          env=cli_env(**env), capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])


def test_cli_server_commands(local_server: LocalServer):
    status = _cli(local_server.env, "server", "status", "-o", "json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["running"] and info["url"] == local_server.url and info["pid"] == local_server.pid
    env = _cli(local_server.env, "server", "env")
    assert env.stdout.splitlines() == [f"export LOOPS_BASE_URL={local_server.url}",
                                       f"export BASETEN_API_KEY={local_server.token}"]
    as_json = json.loads(_cli(local_server.env, "server", "env", "-o", "json").stdout)
    assert as_json == {"LOOPS_BASE_URL": local_server.url, "BASETEN_API_KEY": local_server.token}
    assert _cli(local_server.env, "server", "env", "-q").stdout == env.stdout
    again = _cli(local_server.env, "server", "start")
    assert again.returncode == 0 and "already running" in again.stderr
    logs = _cli(local_server.env, "server", "logs", "-n", "5")
    assert logs.returncode == 0 and 0 < len(logs.stdout.splitlines()) <= 5
    for fmt in ("json", "jsonl"):  # through the sink: one JSON object per line, as `runs logs`
        as_json = _cli(local_server.env, "server", "logs", "-n", "5", "-o", fmt)
        assert as_json.returncode == 0, as_json.stderr
        records = [json.loads(line) for line in as_json.stdout.splitlines()]
        assert 0 < len(records) <= 5 and all(isinstance(r["line"], str) and r.keys() == {"line"} for r in records)
    assert _cli(local_server.env, "server", "logs", "-o", "none").stdout == ""
    assert local_server.token not in local_server.log_text  # the key never reaches the log
    pulled = _cli(local_server.env, "server", "pull-model", MODEL)
    assert pulled.returncode == 0, pulled.stderr


def test_server_logs_follow_ends_with_130_on_ctrl_c(local_server: LocalServer):
    """Ctrl-C is the only way out of --follow: exit 130, as `runs logs -f` and the documented table."""
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", "server", "logs", "-f", "-n", "1", "-o", "jsonl"],
                            env=cli_env(local_server), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
                            preexec_fn=ctrl_c_as_a_terminal_sends)
    first = proc.stdout.readline()  # the last line is printed: following has begun
    assert json.loads(first)["line"], first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err


def test_daemon_start_stop_ensure_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from baseten_loops_cli.local import daemon

    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        monkeypatch.setenv(f"LOOPS_{name}_DIR", str(tmp_path / name.lower()))
    monkeypatch.delenv("LOOPS_NO_AUTOSTART", raising=False)
    assert daemon.status() is None
    messages: list[str] = []
    info = daemon.ensure_running(messages.append, port=0)
    try:
        assert messages and "Starting" in messages[0]
        assert info.url.startswith("http://127.0.0.1:")
        record = (tmp_path / "state" / "server.json").read_text()
        assert str(info.pid) in record and info.url in record
        assert daemon.ensure_running(messages.append).pid == info.pid
        assert len(messages) == 2  # no second start announced
        assert daemon.env_lines()[0] == f"export LOOPS_BASE_URL={info.url}"
        # One server per state dir.
        second = subprocess.run(
            [sys.executable, "-m", "baseten_loops_cli.local.server", "--foreground", "--port",
             "0", "--state-dir", str(tmp_path / "state"), "--data-dir", str(tmp_path / "d2")],
            capture_output=True, text=True, timeout=60, env={**os.environ},
            cwd=Path(__file__).resolve().parents[1])
        assert second.returncode != 0 and "Another local loops server" in second.stderr
    finally:
        assert daemon.stop()
    assert daemon.status() is None and not daemon.stop()


def test_server_stops_when_its_owner_exits(tmp_path: Path):
    from baseten_loops_cli.local import daemon

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    info = daemon.start(0, state_dir=tmp_path / "state", data_dir=tmp_path / "data",
                        owner_pid=owner.pid, options={"preload_engine": False})
    assert daemon.status(tmp_path / "state").pid == info.pid
    owner.wait()
    from baseten_loops_cli.local.daemon import _pid_alive

    wait_for(lambda: not _pid_alive(info.pid), timeout=20, interval=0.05, what="the server to stop")
    assert daemon.status(tmp_path / "state") is None
    assert "owner process" in (tmp_path / "state" / "server.log").read_text()


# ── pull-model: the server fetches/converts, streaming progress (issues 12, 14) ──


def test_pull_model_route_streams_progress(client: httpx.Client):
    events = pull_events(client, "loops-local/tiny")
    assert events[0] == {"event": "start", "model": "loops-local/tiny", "elapsed_s": 0.0}
    assert events[-1]["event"] == "done" and events[-1]["path"] is None  # built in code
    assert_error(client.post("/v1/local/models/pull", json={"model": "nope/none"}), 400,
                 "UnknownBaseModel")
    assert_error(client.post("/v1/local/models/pull", content=b""), 400, "InvalidJson")
    assert_error(client.post("/v1/local/models/pull", json={"name": "x"}), 400,
                 "ValidationError")


def test_pull_model_command_asks_the_server(local_server: LocalServer):
    from cli_support import loops, one_line_error

    result = loops(local_server, "server", "pull-model", "loops-local/tiny")
    assert result.code == 0, result
    assert "Asking the local server to prepare loops-local/tiny" in result.stderr
    assert "loops-local/tiny is ready." in result.stderr and "Ready" in result.stdout
    one_line_error(loops(local_server, "server", "pull-model", "nope/none"), 1,
                   "Unknown base model 'nope/none'", "loops-local/tiny")


@pytest.mark.slow
@pytest.mark.required_in_ci
def test_pull_smollm2_reports_each_step_from_the_start(smollm2_pull: tuple[Path, list[dict]]):
    """Converting the GGUF wheel takes tens of seconds: the stream says so at once and beats
    every second until done (the session's pull: conftest.smollm2_pull)."""
    events = smollm2_pull[1]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[1] == "convert" and kinds[-1] == "done", kinds
    # Announced before the work (second event), and the stream keeps talking during it:
    # heartbeats come between "convert" and "done", in time order.
    assert "heartbeat" in kinds[2:-1], kinds
    stamps = [e["elapsed_s"] for e in events]
    assert stamps == sorted(stamps), stamps
    assert Path(events[-1]["path"], "tokenizer.json").is_file()


# ── the compute policy (--dtype / --device) is honoured end to end ──

def test_dtype_and_device_are_honoured_end_to_end(server_factory):
    server = server_factory(dtype="bfloat16", device="cpu")
    with server.client(timeout=120) as client:
        trainer = new_run(client)
        result = trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        assert result["metrics"]["compute_bf16"] == 1.0  # in each step's metrics
        compute = client.get("/v1/local/status").json()["compute"]
    assert compute["requested_dtype"] == compute["dtype"] == "bfloat16"
    assert compute["requested_device"] == compute["device"] == "cpu"
    status = _cli(server.env, "server", "status", "-o", "json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["compute"]["dtype"] == "bfloat16"
    table = _cli(server.env, "server", "status")
    assert "bfloat16 on cpu" in table.stdout, table.stdout


def test_activation_checkpointing_option_reaches_the_trainer(server_factory):
    """The server's activation_checkpointing option (issue 40): "on" recomputes every decoder
    layer of the tiny model in each backward (the step's metrics say how many), and the
    status reports the mode."""
    server = server_factory(activation_checkpointing="on")
    with server.client(timeout=120) as client:
        trainer = new_run(client)
        result = trainer.do("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"})
        assert result["metrics"]["recomputed_layers"] == 4.0  # the tiny model's layers
        forward = trainer.do("forward", {"data": DATA, "loss_fn": "cross_entropy"})
        assert "recomputed_layers" not in forward["metrics"]  # nothing to recompute
        compute = client.get("/v1/local/status").json()["compute"]
    assert compute["activation_checkpointing"] == "on"


def _assert_start_refused(proc, tmp_path, *, code: int, error: str, hint: str) -> None:
    """`loops server start` refused in one Error line naming ``error``, a Hint naming ``hint``,
    exit ``code``, no traceback, and nothing started."""
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("Error: ") and error in lines[0], proc.stderr
    assert any(line.startswith("Hint: ") and hint in line for line in lines)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state" / "server.json").exists()  # nothing was started


def test_an_unknown_activation_checkpointing_mode_is_a_one_line_usage_error(tmp_path):
    dirs = {f"LOOPS_{name}_DIR": str(tmp_path / name.lower()) for name in ("STATE", "DATA", "CONFIG", "CACHE")}
    bad = _cli({**dirs, "LOOPS_ACTIVATION_CHECKPOINTING": "sometimes"}, "server", "start")
    _assert_start_refused(bad, tmp_path, code=2, error="'sometimes'", hint="auto, on, off")


def test_fixture_servers_compute_in_float32(local_server: LocalServer):
    with local_server.client(timeout=120) as client:
        trainer = new_run(client)
        result = trainer.do("forward", {"data": DATA, "loss_fn": "cross_entropy"})
        assert result["metrics"]["compute_bf16"] == 0.0
        compute = client.get("/v1/local/status").json()["compute"]
    assert (compute["dtype"], compute["device"]) == ("float32", "cpu")


def test_server_start_on_cuda_without_cuda_is_a_one_line_error(tmp_path):
    dirs = {f"LOOPS_{name}_DIR": str(tmp_path / name.lower()) for name in ("STATE", "DATA", "CONFIG", "CACHE")}
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU machine too.
    started = _cli({**dirs, "CUDA_VISIBLE_DEVICES": ""}, "server", "start", "--device", "cuda")
    _assert_start_refused(started, tmp_path, code=1, error="no CUDA device", hint="--device cpu")
    bad = _cli(dirs, "server", "start", "--dtype", "float16")
    assert bad.returncode == 2 and "float16" in bad.stderr  # a usage error, before anything starts
