"""The local server SIGKILLed mid-run, then restarted on the same dirs and port: runs,
checkpoints, logs and metrics are intact, and training resumed from the last checkpoint ends
with the same step count and the same adapter as an uninterrupted run."""

from __future__ import annotations

import os
import time

import httpx
import pytest

pytest.importorskip("torch")

from tests.support import cli_env, kill, wait_for  # noqa: E402
from tests.test_reliability_faults import BATCHES, adapter_tensors, assert_same_adapter  # noqa: E402

MODEL = "loops-local/tiny"
STEPS = 6
SAVE_EVERY = 2


def _new_run(c: httpx.Client, seed: int) -> dict:
    session = c.post("/v1/loops/sessions", json={}).json()["session"]["id"]
    r = c.post("/v1/loops/runs", json={"session_id": session, "base_model": MODEL, "lora_rank": 4,
                                        "seed": seed, "name": f"kill-{seed}"})
    assert r.status_code == 200, r.text
    return r.json()["run"]


def _client(server, run: dict, **kw):
    from baseten_loops_cli.workers.trainer import TrainerClient

    return TrainerClient(f"{server.url}/trainers/{run['id']}", api_key=server.token, run_id=run["id"],
                         base_model=MODEL, **kw)


def _steps(tc, start: int, stop: int) -> None:
    for step in range(start, stop):
        fb = tc.forward_backward(BATCHES[step % len(BATCHES)])
        opt = tc.optim_step({"learning_rate": 0.05})
        fb.result(timeout=300)
        opt.result(timeout=300)
        if (step + 1) % SAVE_EVERY == 0:
            tc.save_state(f"step-{step + 1}").result(timeout=300)


def test_server_sigkill_mid_run_then_restart_and_resume(server_factory):
    server = server_factory()
    with server.client() as c:
        clean, victim = _new_run(c, seed=3), _new_run(c, seed=3)
    with _client(server, clean) as tc:
        _steps(tc, 0, STEPS)
        tc.save_weights_for_sampler("final").result(timeout=300)
        assert tc.policy_version() == STEPS

    # The victim: 3 steps (checkpoint step-2 saved), then a step in flight when the server dies.
    # (Short budgets: the worker client's defaults retry a vanished server for 10 min, as the
    # SDK does; `loops train` is tested for a prompt exit in the CLI kill tests. The submit
    # budget is what the step after the kill waits out.)
    with _client(server, victim, submit_timeout=3, result_timeout=10) as tc:
        _steps(tc, 0, 3)
        tc.forward_backward(BATCHES[3])
        with server.client() as c:
            before = {
                "run": c.get(f"/v1/loops/runs/{victim['id']}").json()["run"],
                "checkpoints": sorted(x["checkpoint_id"] for x in c.get(
                    "/v1/loops/checkpoints", params={"run_id": victim["id"]}).json()["checkpoints"]),
                "usage": c.get("/v1/local/usage", params={"run_id": victim["id"]}).json()["usage"],
            }
        kill(server)
        # The client sees the server gone: a bounded, typed error, not a hang.
        from baseten_loops_cli.errors import LoopsError

        # A typed error from the transport giving up (not a hang: pytest-timeout would end it).
        with pytest.raises(LoopsError) as info:
            tc.optim_step({"learning_rate": 0.05}).result(timeout=10)
        assert "could not reach" in info.value.message or "timed out" in info.value.message, info.value.message

    server.start()  # same dirs, same port
    with server.client() as c:
        runs = {r["id"]: r for r in c.get("/v1/loops/runs", params={"all": "true"}).json()["runs"]}
        assert victim["id"] in runs and clean["id"] in runs
        after_run = c.get(f"/v1/loops/runs/{victim['id']}").json()["run"]
        assert after_run["id"] == before["run"]["id"] and after_run["base_model"] == MODEL
        cps = c.get("/v1/loops/checkpoints", params={"run_id": victim["id"]}).json()["checkpoints"]
        assert sorted(x["checkpoint_id"] for x in cps) == before["checkpoints"] == ["step-2"]
        for cp in cps:  # every checkpoint file still downloads, at its listed size
            for f in c.get(f"/v1/loops/checkpoints/{cp['id']}/files").json()["presigned_urls"]:
                body = httpx.get(f["url"], timeout=30).content
                assert len(body) == f["size_bytes"], f["relative_file_name"]
        usage = c.get("/v1/local/usage", params={"run_id": victim["id"]}).json()["usage"]
        assert usage and usage[0]["operations"] >= before["usage"][0]["operations"]
        logs = c.get(f"/v1/loops/deployments/{after_run['deployment_id']}/logs").json()
        assert logs

    # Resume from the last checkpoint, as `loops train resume` does, to the same end.
    with _client(server, victim) as tc:
        step = tc.load_state_with_optimizer(f"bt://loops:{victim['id']}/weights/step-2").result(timeout=300)
        assert step.get("step") == 2
        _steps(tc, 2, STEPS)
        tc.save_weights_for_sampler("final").result(timeout=300)
        assert tc.policy_version() == STEPS
    assert_same_adapter(adapter_tensors(server, clean["id"]), adapter_tensors(server, victim["id"]))


CLIENT_EXIT_BUDGET_S = float(os.environ.get("LOOPS_SERVER_KILL_EXIT_S", "120"))


def test_server_killed_under_loops_train_then_restart_and_resume(server_factory, tmp_path):
    """`loops train run` with its server SIGKILLed mid-run: the CLI exits (promptly, non-zero)
    with a clear message and the resume command; after a restart the run, its checkpoints and
    metrics are intact and `loops train resume` finishes with the uninterrupted run's adapter."""
    import json
    import subprocess
    import sys

    from tests.test_reliability_faults import loops, run_dir_result, sft_config

    server = server_factory()
    config = sft_config(tmp_path, steps=8, save_every=2, seed=13)
    # The run gives up on its unreachable trainer after 2 s instead of the default 45 s
    # (LOOPS_UNREACHABLE_TIMEOUT): what is tested is how it stops, not how long it waits.
    env = cli_env(server, LOOPS_UNREACHABLE_TIMEOUT="2")
    clean = loops(["train", "run", str(config), "--run-dir", str(tmp_path / "clean")], env, tmp_path)
    assert clean.returncode == 0, clean.stderr

    run_dir = tmp_path / "victim"
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", "train", "run", str(config),
                             "--run-dir", str(run_dir)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: proc.poll() is not None or (metrics.exists() and len(metrics.read_text().splitlines()) >= 3),
             timeout=120, interval=0.02, what="3 steps in metrics.jsonl")
    assert proc.poll() is None, "training finished before the server could be killed"
    run_id = json.loads((run_dir / "state.json").read_text())["run_id"]
    with server.client() as c:
        cps_before = sorted(x["checkpoint_id"] for x in c.get(
            "/v1/loops/checkpoints", params={"run_id": run_id}).json()["checkpoints"])
    kill(server)
    problems: list[str] = []
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=CLIENT_EXIT_BUDGET_S)
    except subprocess.TimeoutExpired:
        out, err = kill(proc, group=True)
        problems.append(f"`loops train run` was still running {CLIENT_EXIT_BUDGET_S:.0f}s after its server "
                        f"died (killed by the test); stderr tail:\n{err[-1500:]}")
    else:
        print(f"\nCLI exited {proc.returncode} {time.monotonic() - t0:.1f}s after the server was killed")
        if proc.returncode in (0, None):
            problems.append(f"exit code {proc.returncode} after the server died")
        if "Traceback" in err:
            problems.append("a traceback instead of a message:\n" + err[-1500:])
        if f"loops train resume {run_dir}" not in err:
            problems.append("no resume command in:\n" + err[-1500:])
    metrics_before = metrics.read_text()

    server.start()  # same dirs and port
    with server.client() as c:
        assert c.get(f"/v1/loops/runs/{run_id}").status_code == 200
        cps_after = sorted(x["checkpoint_id"] for x in c.get(
            "/v1/loops/checkpoints", params={"run_id": run_id}).json()["checkpoints"])
    assert cps_after == cps_before and cps_after, (cps_before, cps_after)
    assert metrics.read_text() == metrics_before  # the client's metrics are untouched

    # A bad value is refused before anything is created, naming the variable and the fix.
    bad = loops(["train", "resume", str(run_dir)], {**env, "LOOPS_UNREACHABLE_TIMEOUT": "soon"}, tmp_path)
    assert bad.returncode == 2 and "LOOPS_UNREACHABLE_TIMEOUT='soon'" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and metrics.read_text() == metrics_before
    resumed = loops(["train", "resume", str(run_dir)], env, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    steps, rid, name = run_dir_result(run_dir)
    clean_steps, clean_run, clean_name = run_dir_result(tmp_path / "clean")
    assert steps == clean_steps == 8
    trained = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"loss"' in x]
    assert trained == list(range(1, 9)), trained
    assert_same_adapter(adapter_tensors(server, clean_run, clean_name), adapter_tensors(server, rid, name))
    assert not problems, "\n".join(problems)
