"""After a clean restart or a crash (SIGKILL), a run, its trainer and its sampler report one
consistent state in every route: `GET /v1/loops/runs` and `/runs/{id}`, the trainer's
deployment (`/v1/loops/deployments`, what `loops usage` reads) and its `/health`, the
samplers list and get, and `loops usage -o json`. Runs are put in every state at once
(training with an op in flight, idle, scaled to zero, deactivated, sampler deactivated alone,
never trained) and all routes are compared before and after each restart."""

from __future__ import annotations


import pytest

from tests.cli_support import chat_datum, loops, trainer
from tests.support import kill, wait_for

pytest.importorskip("torch")

TINY = "loops-local/tiny"
LIVE = ("ACTIVE", "SCALED_TO_ZERO")  # a live sampler
TRAINER_LIVE = ("CREATED", "DEPLOYING", "RUNNING", "SCALED_TO_ZERO")


def _call(server, method: str, path: str, **kw):
    with server.client() as c:
        return c.request(method, path, **kw)


def _new_run(server, name: str, **extra) -> dict:
    session = _call(server, "POST", "/v1/loops/sessions", json={}).json()["session"]["id"]
    resp = _call(server, "POST", "/v1/loops/runs", json={"session_id": session, "base_model": TINY, "lora_rank": 4,
                                                         "name": name, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()["run"]


def _step(server, run_id: str) -> None:
    with trainer(server, run_id) as tc:
        tc.forward_backward([chat_datum()], "cross_entropy").result(timeout=120)
        tc.optim_step({"learning_rate": 1e-3}).result(timeout=120)


def _name(obj) -> str | None:
    return None if obj is None else obj["status"]["name"]


def statuses(server, run_id: str) -> tuple[str, str, str | None]:
    """(run, trainer, sampler) status, asserting that every route reports the same."""
    run = _call(server, "GET", f"/v1/loops/runs/{run_id}").json()["run"]
    listed = next(r for r in _call(server, "GET", "/v1/loops/runs").json()["runs"] if r["id"] == run_id)
    dep = _call(server, "GET", f"/v1/loops/deployments/{run['deployment_id']}").json()["deployment"]
    deps = {d["id"]: d for d in _call(server, "GET", "/v1/loops/deployments").json()["deployments"]}
    samplers = [s for s in _call(server, "GET", "/v1/loops/samplers").json()["samplers"] if s["run_id"] == run_id]
    usage = [r for r in loops(server, "usage", "--all", "-o", "json").json()["rows"] if r["run_id"] == run_id]
    health = _call(server, "GET", f"/trainers/{run_id}/health")
    where = f"run {run_id}"

    run_status, trainer_status, sampler = _name(run), _name(dep), run["sampler"]
    sampler_status = _name(sampler)
    assert (_name(listed), _name(listed["sampler"])) == (run_status, sampler_status), where
    assert _name(deps[dep["id"]]) == trainer_status and _name(deps[dep["id"]]["sampler"]) == sampler_status, where
    assert (dep["active_run_id"] == run_id) == (run_status == "ACTIVE"), where
    if sampler is not None:
        got = _call(server, "GET", f"/v1/loops/samplers/{sampler['id']}").json()["sampler"]
        assert _name(got) == sampler_status, where
        assert {s["id"]: _name(s) for s in samplers}[sampler["id"]] == sampler_status, where
        # a run's other samplers (replaced ones) are all deactivated
        assert all(_name(s) == "INACTIVE" for s in samplers if s["id"] != sampler["id"]), where
    assert [(r["trainer_status"], r["sampler_status"]) for r in usage] == [(trainer_status, sampler_status)], usage
    if run_status == "ACTIVE" and trainer_status in ("CREATED", "DEPLOYING"):  # still loading
        assert health.status_code in (200, 503), health.text
    elif run_status == "ACTIVE":
        assert health.status_code == 200 and health.json()["deployment_status"] == trainer_status, health.text
        assert trainer_status in TRAINER_LIVE + ("FAILED",), where
    else:
        assert health.status_code == 409 and health.json()["error_class"] == "RunInactive", health.text
        assert trainer_status in ("STOPPED", "FAILED") and sampler_status in (None, "INACTIVE"), where
    return run_status, trainer_status, sampler_status


def _trainer_and_sampler(server, run_id: str) -> tuple[str | None, str | None]:
    """The trainer's and the sampler's status from the control plane alone. Waiting for a scale
    down must not poll the trainer's /health: that is the SDK's heartbeat, which keeps a trainer
    warm, so polling it faster than the run's delay would hold the trainer RUNNING forever."""
    run = _call(server, "GET", f"/v1/loops/runs/{run_id}").json()["run"]
    dep = _call(server, "GET", f"/v1/loops/deployments/{run['deployment_id']}").json()["deployment"]
    return _name(dep), _name(run["sampler"])


def _jobs(server) -> list[str]:
    """What the server's compute lanes run now (its own account: ``/v1/local/status``)."""
    return [job for m in _call(server, "GET", "/v1/local/status").json()["models"] for job in m["current_jobs"]]


@pytest.mark.parametrize("how", ["restart", "crash"])
def test_every_route_agrees_after_a_restart_in_every_state(server_factory, how):
    server = server_factory()
    runs = {
        "training": _new_run(server, "training"),
        "idle": _new_run(server, "idle"),
        "scaled": _new_run(server, "scaled", scale_down_delay_seconds=1),
        "deactivated": _new_run(server, "deactivated"),
        "sampler-off": _new_run(server, "sampler-off"),
        "fresh": _new_run(server, "fresh"),
    }
    for name in ("training", "idle", "scaled", "deactivated", "sampler-off"):
        _step(server, runs[name]["id"])
    wait_for(lambda: _trainer_and_sampler(server, runs["scaled"]["id"]) == ("SCALED_TO_ZERO", "SCALED_TO_ZERO"))
    assert statuses(server, runs["scaled"]["id"]) == ("ACTIVE", "SCALED_TO_ZERO", "SCALED_TO_ZERO")
    assert _call(server, "POST", f"/v1/loops/runs/{runs['deactivated']['id']}/deactivate").status_code == 200
    sampler_id = runs["sampler-off"]["sampler"]["id"]
    assert _call(server, "POST", f"/v1/loops/samplers/{sampler_id}/deactivate").status_code == 200
    before = {name: statuses(server, run["id"]) for name, run in runs.items()}
    assert before["idle"] == ("ACTIVE", "RUNNING", "ACTIVE")
    assert before["deactivated"] == ("INACTIVE", "STOPPED", "INACTIVE")
    assert before["sampler-off"] == ("ACTIVE", "RUNNING", "INACTIVE")

    # An op in flight while the server goes down (its compute job is held a few seconds).
    assert _call(server, "POST", "/v1/local/faults", json={"job": "forward_backward *", "delay_s": 3}).status_code == 200
    tc = trainer(server, runs["training"]["id"])
    future = tc.forward_backward([chat_datum()], "cross_entropy")
    wait_for(lambda: any(m["current_job"] and m["current_job"].startswith("forward_backward")
                         for m in _call(server, "GET", "/v1/local/status").json()["models"]), interval=0.05)
    if how == "crash":
        kill(server)
        server.start()
    else:
        server.restart()
    tc.close()
    del future

    after = {name: statuses(server, run["id"]) for name, run in runs.items()}
    # Nothing is in memory after a restart: live trainers and samplers come back scaled to
    # zero (the next op or sample wakes them); deactivated ones stay down.
    for name in ("training", "idle", "scaled", "fresh"):
        assert after[name] == ("ACTIVE", "SCALED_TO_ZERO", "SCALED_TO_ZERO"), (name, after[name])
    assert after["deactivated"] == ("INACTIVE", "STOPPED", "INACTIVE")
    assert after["sampler-off"] == ("ACTIVE", "SCALED_TO_ZERO", "INACTIVE")

    # And they come back: a step wakes the trainer, a sample wakes the sampler, in every route.
    _step(server, runs["idle"]["id"])
    from baseten_loops_cli.workers.sampler import SamplerClient

    with SamplerClient(runs["idle"]["sampler"]["base_url"], api_key=server.token, run_id=runs["idle"]["id"]) as sc:
        sc.sample([1, 2, 3], max_tokens=2)
    assert statuses(server, runs["idle"]["id"]) == ("ACTIVE", "RUNNING", "ACTIVE")


def test_a_deactivation_cut_short_by_a_crash_is_finished_on_restart(server_factory):
    """A run marked INACTIVE whose trainer and sampler rows still say RUNNING / ACTIVE (what a
    crash between separate writes left behind before deactivation became one transaction) is
    made consistent when the server starts."""
    import sqlite3

    server = server_factory()
    run = _new_run(server, "half-deactivated")
    wait_for(lambda: _name(_call(server, "GET", f"/v1/loops/deployments/{run['deployment_id']}").json()["deployment"])
             == "RUNNING")
    assert statuses(server, run["id"]) == ("ACTIVE", "RUNNING", "ACTIVE")
    kill(server)
    with sqlite3.connect(server.data_dir / "loops.db") as db:
        db.execute("UPDATE runs SET status = 'INACTIVE' WHERE id = ?", (run["id"],))
        db.execute("UPDATE deployments SET status = 'RUNNING' WHERE id = ?", (run["deployment_id"],))
        db.execute("UPDATE samplers SET status = 'ACTIVE' WHERE run_id = ?", (run["id"],))
    server.start()
    assert statuses(server, run["id"]) == ("INACTIVE", "STOPPED", "INACTIVE")


def test_a_run_deactivated_while_its_trainer_loads_stays_stopped(server_factory):
    """Deactivation during the trainer's load: when the load ends, the trainer deployment keeps
    the STOPPED status the deactivation gave it (it used to turn RUNNING under an INACTIVE run)
    and its log does not report a running trainer after the deactivation."""
    server = server_factory()
    # The deploy job of the next run holds its load for 3 s: a deactivation lands inside it.
    assert _call(server, "POST", "/v1/local/faults", json={"job": "deploy *", "delay_s": 3, "times": 1}).status_code == 200
    run = _new_run(server, "deactivated-while-loading")
    wait_for(lambda: _trainer_and_sampler(server, run["id"])[0] == "DEPLOYING", timeout=60)
    load = f"deploy {run['id']}"
    wait_for(lambda: load in _jobs(server), interval=0.05, what="the held load to start")
    assert _call(server, "POST", f"/v1/loops/runs/{run['id']}/deactivate").status_code == 200
    assert statuses(server, run["id"])[:2] == ("INACTIVE", "STOPPED")
    # The load ends (at once: clearing the faults ends its hold), and whatever it writes then
    # is written before the server says the job is done.
    assert _call(server, "DELETE", "/v1/local/faults").status_code == 200
    wait_for(lambda: load not in _jobs(server), interval=0.05, what="the held load to end")
    assert statuses(server, run["id"])[:2] == ("INACTIVE", "STOPPED")
    logs = _call(server, "GET", f"/v1/loops/deployments/{run['deployment_id']}/logs",
                 params={"direction": "asc"}).json()["logs"]
    messages = [line["message"] for line in logs]
    deactivated = next(i for i, m in enumerate(messages) if m.startswith("Run deactivated"))
    assert not any(m.startswith("Trainer running") for m in messages[deactivated:]), messages
