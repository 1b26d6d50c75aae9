"""`logging.trackers: [tensorboard, mlflow, trackio]`: a tiny run stopped by Ctrl-C and resumed
writes files that the trackers' own readers load (TensorBoard's event accumulator, MLflow's
client on its local file store, trackio's SQLite store): the same metric names and values as
metrics.jsonl, each step once, the resolved config as parameters, one tracker run across the
resume."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.cli_support import start_loops, trained_steps, wait_for

pytest.importorskip("torch")
pytestmark = [pytest.mark.local, pytest.mark.required_in_ci]
tensorboard = pytest.importorskip("tensorboard")
mlflow = pytest.importorskip("mlflow")
trackio = pytest.importorskip("trackio")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 4


def test_trackers_read_back_by_their_own_readers_across_a_resume(local_server, tmp_path, monkeypatch):
    from tests.test_reliability_faults import cli_env, loops

    env = cli_env(local_server)
    env["TRACKIO_DIR"] = str(tmp_path / "trackio")
    env.pop("MLFLOW_TRACKING_URI", None)
    run_dir = tmp_path / "run"
    sets = [f"max_steps={STEPS}", "eval_every=2", "checkpointing.save_every=1", "name=tracked",
            "logging.trackers=[tensorboard,mlflow,trackio]"]
    args = ["train", "run", str(EXAMPLES / "tiny-sft.yaml"), *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir)]
    proc = start_loops(args, env, tmp_path)
    wait_for(lambda: proc.poll() is not None or len(trained_steps(run_dir)) >= 2, timeout=180)
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: stop after the step in flight
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    first_state = json.loads((run_dir / "state.json").read_text())
    mlflow_run = first_state["trackers"]["mlflow_run_id"]
    resumed = loops(["train", "resume", str(run_dir)], env, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "completed" and state["trackers"]["mlflow_run_id"] == mlflow_run  # the same MLflow run
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if not r.get("final")]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    expected = {(r["step"], k): float(v) for r in steps for k, v in r.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    resolved = _flat(__import__("yaml").safe_load((run_dir / "config.yaml").read_text()))

    # TensorBoard: its own event reader; a resume's replayed steps are purged, so each step once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = run_dir / "trackers" / "tensorboard" / "tracked"
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    got = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] if not tag.startswith("final/")
           for e in acc.Scalars(tag)}
    assert sorted({tag for _, tag in got}) == sorted({k for _, k in expected})
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, STEPS + 1))
    assert got == pytest.approx(expected, rel=1e-6)

    # MLflow: its client on the local file store; one run, parameters = the resolved config.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's switch for its file store
    client = MlflowClient(tracking_uri=(run_dir / "trackers" / "mlruns").as_uri())
    run = client.get_run(mlflow_run)
    assert run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in resolved.items()}
    # A resume logs the replayed steps again (MLflow keeps every value); the last one per step counts.
    history = {m.step: m.value for m in sorted(client.get_metric_history(mlflow_run, "loss"), key=lambda m: m.timestamp)}
    assert history == pytest.approx({r["step"]: r["loss"] for r in steps})
    last = run.data.metrics
    assert last["loss"] == pytest.approx(steps[-1]["loss"])
    assert last["eval_loss"] == pytest.approx(steps[-1]["eval_loss"])

    # trackio: its local SQLite store; one run, every step's metrics.
    import trackio.sqlite_storage
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")  # read at import

    assert SQLiteStorage.get_runs("tracked") == ["tracked"]
    logs = SQLiteStorage.get_logs("tracked", "tracked")
    by_step = {}
    for log in logs:
        if "loss" in log:
            by_step[int(log["step"])] = log["loss"]
    assert by_step == pytest.approx({r["step"]: r["loss"] for r in steps})
    config = SQLiteStorage.get_run_config("tracked", "tracked") or {}
    assert config.get("optimizer.learning_rate") == str(resolved["optimizer.learning_rate"])


def _flat(raw: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_a_sweeps_parallel_runs_share_one_experiment_and_one_parent_run(tmp_path, monkeypatch):
    """Two runs of a sweep opening MLflow at the same moment: the file store lets both create the
    sweep's experiment (or one fails 'already exists' and loses its MLflow run); the sweep's lock
    makes one experiment, one parent, and a run for each."""
    import threading
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from baseten_loops_cli.training.experiments.rundir import SWEEP_INDEX, RunDir
    from baseten_loops_cli.training.experiments.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    config = SimpleNamespace(name="swept", logging=SimpleNamespace(trackers=["mlflow"], tracker_dir=None))
    for trial in range(6):
        sweep = tmp_path / f"sweep{trial}"
        sweep.mkdir()
        (sweep / SWEEP_INDEX).write_text("{}")
        rundirs = [RunDir(sweep / name) for name in ("00-seed=1", "01-seed=2")]
        for rundir in rundirs:
            rundir.path.mkdir()
        barrier = threading.Barrier(len(rundirs))

        def open_one(rundir: RunDir) -> None:
            barrier.wait()
            trackers, _ = open_trackers(config, rundir, raw_config={"seed": 1}, start_step=0)
            trackers.finish()

        threads = [threading.Thread(target=open_one, args=(r,)) for r in rundirs]
        [t.start() for t in threads]
        [t.join() for t in threads]
        client = MlflowClient(tracking_uri=(sweep / "trackers" / "mlruns").as_uri())
        experiments = [e for e in client.search_experiments() if e.name == sweep.name]
        assert len(experiments) == 1, experiments
        parent = json.loads((sweep / "trackers.json").read_text())["mlflow_parent_run_id"]
        for rundir in rundirs:
            run = client.get_run(rundir.read_state()["trackers"]["mlflow_run_id"])  # KeyError: its MLflow run was lost
            assert run.info.experiment_id == experiments[0].experiment_id
            assert run.data.tags["mlflow.parentRunId"] == parent
