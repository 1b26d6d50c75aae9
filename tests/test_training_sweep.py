"""`loops train sweep` against the real local server: a 2x2 grid run two at a time, SIGKILLed
midway, resumed; every run trains exactly once and ends as the same run made alone. Then
`loops train compare` of the sweep in table, JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
from pathlib import Path

import pytest

from tests.cli_support import start_loops, trained_steps, wait_for

pytest.importorskip("torch")
pytestmark = pytest.mark.local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 3
SETS = [f"max_steps={STEPS}", "eval_every=2", "checkpointing.save_every=1"]
GRID = ["--grid", "optimizer.learning_rate=0.001,0.003", "--grid", "lora_rank=4,8"]
POINTS = {  # run directory name -> its --set values
    "00-learning_rate=0.001-lora_rank=4": ["optimizer.learning_rate=0.001", "lora_rank=4"],
    "01-learning_rate=0.001-lora_rank=8": ["optimizer.learning_rate=0.001", "lora_rank=8"],
    "02-learning_rate=0.003-lora_rank=4": ["optimizer.learning_rate=0.003", "lora_rank=4"],
    "03-learning_rate=0.003-lora_rank=8": ["optimizer.learning_rate=0.003", "lora_rank=8"],
}


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def test_sweep_killed_midway_resumes_each_run_exactly_once(local_server, tmp_path):
    from tests.test_reliability_faults import adapter_tensors, assert_same_adapter, cli_env, loops, run_dir_result

    env = cli_env(local_server)
    config = EXAMPLES / "tiny-sft.yaml"
    sweep_dir = tmp_path / "sweep"
    proc = start_loops(["train", "sweep", str(config), *_sets(SETS), *GRID, "--parallel", "2",
                        "--sweep-dir", str(sweep_dir)], env, tmp_path)
    # Midway: the first two runs are training (two at a time), the last two not started.
    wait_for(lambda: proc.poll() is not None or sum(bool(trained_steps(sweep_dir / n)) for n in POINTS) >= 2, timeout=240)
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGKILL)  # the sweep process only: its runs are told (PDEATHSIG) and stop cleanly
    proc.communicate(timeout=60)
    index = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["dir"] for r in index["runs"]] == list(POINTS)
    assert not (sweep_dir / list(POINTS)[3] / "state.json").exists()  # never started

    resumed = loops(["train", "resume", str(sweep_dir)], env, tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    for name in POINTS:
        run_dir = sweep_dir / name
        assert json.loads((run_dir / "state.json").read_text())["status"] == "completed", name
        assert trained_steps(run_dir) == list(range(1, STEPS + 1)), (name, trained_steps(run_dir))
    # A second resume has nothing left to do: each run trains exactly once.
    again = loops(["train", "resume", str(sweep_dir)], env, tmp_path)
    assert again.returncode == 0 and "4 of 4 runs already completed" in again.stderr, again.stderr

    # Each run ends as the same run made alone: its steps and its adapter.
    for name in ("00-learning_rate=0.001-lora_rank=4", "03-learning_rate=0.003-lora_rank=8"):
        alone = tmp_path / f"alone-{name}"
        made = loops(["train", "run", str(config), *_sets(SETS + POINTS[name]), "--run-dir", str(alone)], env, tmp_path)
        assert made.returncode == 0, made.stderr
        steps, run_id, ckpt = run_dir_result(sweep_dir / name)
        alone_steps, alone_run, alone_ckpt = run_dir_result(alone)
        assert steps == alone_steps == STEPS
        assert_same_adapter(adapter_tensors(local_server, alone_run, alone_ckpt), adapter_tensors(local_server, run_id, ckpt))

    # compare: one row per run, the keys that differ, the best value marked.
    table = loops(["train", "compare", str(sweep_dir), "--sort", "final_loss"], env, tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["run", "status", "lora_rank", "optimizer.learning_rate"]
    assert len(lines) == 5 and all("completed" in line for line in lines[1:])
    assert "*" in lines[1]  # sorted by final_loss: the first row holds the best one
    doc = json.loads(loops(["-o", "json", "train", "compare", str(sweep_dir)], env, tmp_path).stdout)
    assert doc["keys"] == ["lora_rank", "optimizer.learning_rate"]
    rows = {Path(r["run"]).name: r for r in doc["runs"]}
    assert set(rows) == set(POINTS)
    for name, row in rows.items():
        record = [json.loads(x) for x in (sweep_dir / name / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in record if not r.get("final")]
        assert row["steps"] == STEPS and row["final_loss"] == steps[-1]["loss"]
        assert row["best_loss"] == min(r["loss"] for r in steps)
        assert row["tokens"] == sum(r["tokens"] for r in steps)
    best_run = min(doc["runs"], key=lambda r: r["final_loss"])
    assert doc["best"]["final_loss"] == [best_run["run"]] and "final_loss" in best_run["best"]
    text = loops(["-o", "csv", "train", "compare", str(sweep_dir)], env, tmp_path).stdout
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert len(parsed) == 4 and parsed[0]["lora_rank"] in ("4", "8")
    assert {float(r["final_loss"]) for r in parsed} == {r["final_loss"] for r in doc["runs"]}


@pytest.mark.required_in_ci  # the trackers are in the dev extra
def test_ctrl_c_stops_every_run_of_a_sweep_then_resume_finishes(local_server, tmp_path, monkeypatch):
    """Ctrl-C, resume, and the trackers grouping the sweep's runs: one MLflow parent run with
    both runs nested (each kept across the resume), one trackio project, one TensorBoard logdir."""
    from tests.test_reliability_faults import cli_env, loops

    env = cli_env(local_server)
    env["TRACKIO_DIR"] = str(tmp_path / "trackio")
    env.pop("MLFLOW_TRACKING_URI", None)
    sweep_dir = tmp_path / "sweep"
    sets = ["max_steps=6", "eval_every=0", "checkpointing.save_every=1", "data.eval=null",
            "logging.trackers=[tensorboard,mlflow,trackio]"]
    proc = start_loops(["train", "sweep", str(EXAMPLES / "tiny-sft.yaml"), *_sets(sets),
                        "--grid", "seed=1,2", "--parallel", "2", "--sweep-dir", str(sweep_dir)], env, tmp_path)
    runs = [sweep_dir / "00-seed=1", sweep_dir / "01-seed=2"]
    wait_for(lambda: proc.poll() is not None or all(trained_steps(r) for r in runs), timeout=240)
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err
    assert f"loops train resume {sweep_dir}" in err
    for run in runs:
        state = json.loads((run / "state.json").read_text())
        assert state["status"] in ("interrupted", "completed"), state
    mlflow_runs = [json.loads((run / "state.json").read_text())["trackers"]["mlflow_run_id"] for run in runs]
    resumed = loops(["train", "resume", str(sweep_dir)], env, tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    for run, mlflow_run in zip(runs, mlflow_runs):
        assert trained_steps(run) == list(range(1, 7)), trained_steps(run)
        assert json.loads((run / "state.json").read_text())["trackers"]["mlflow_run_id"] == mlflow_run

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(sweep_dir / "trackers" / "mlruns").as_uri())
    parent = json.loads((sweep_dir / "trackers.json").read_text())["mlflow_parent_run_id"]
    assert client.get_run(parent).info.run_name == "sweep"
    for run, mlflow_run in zip(runs, mlflow_runs):
        child = client.get_run(mlflow_run)
        assert child.data.tags["mlflow.parentRunId"] == parent and child.info.run_name == run.name
        assert child.data.params["seed"] == run.name.split("=")[1]
        assert [m.step for m in client.get_metric_history(mlflow_run, "loss")][-1] == 6
    import trackio.sqlite_storage
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")
    assert sorted(SQLiteStorage.get_runs("sweep")) == [r.name for r in runs]  # the project is the sweep
    assert sorted(p.name for p in (sweep_dir / "trackers" / "tensorboard").iterdir()) == [r.name for r in runs]


def test_a_failed_run_does_not_stop_the_others(local_server, tmp_path, monkeypatch):
    """The first point fails in its own process (a value only its run checks: the index was
    edited after the sweep checked it); the second still trains; the result names the failure."""
    from baseten_loops_cli.cli.train import sweep_child_command
    from baseten_loops_cli.training.experiments import sweep as sweeps
    from tests.test_reliability_faults import cli_env

    for key, value in cli_env(local_server).items():
        monkeypatch.setenv(key, value)
    spec = sweeps.SweepSpec(grid={"lora_rank": ["lots", "4"]})
    points = sweeps.points(spec)
    sweep = sweeps.create(tmp_path / "sweep", EXAMPLES / "tiny-sft.yaml",
                          ["max_steps=1", "eval_every=0", "data.eval=null"], spec, points, parallel=1)
    events: list[str] = []
    result = sweeps.run(sweep, parallel=1, command=sweep_child_command([]), on_event=events.append)
    assert [o.status for o in result.outcomes] == ["failed", "completed"], events
    assert [o.point.name for o in result.failed] == ["00-lora_rank=lots"]
    assert "lora_rank" in result.failed[0].error and "integer" in result.failed[0].error
    assert trained_steps(sweep.path / "01-lora_rank=4") == [1]


def test_points_are_the_product_or_distinct_seeded_draws_each_in_its_own_directory():
    from baseten_loops_cli.training.experiments import sweep as sweeps

    grid = sweeps.parse_grid(["optimizer.learning_rate=1e-4,3e-4,1e-3", "lora_rank=4,8"])
    every = sweeps.points(sweeps.SweepSpec(grid=grid))
    assert [p.params for p in every][:2] == [{"optimizer.learning_rate": "1e-4", "lora_rank": "4"},
                                             {"optimizer.learning_rate": "1e-4", "lora_rank": "8"}]
    assert len({p.name for p in every}) == len(every) == 6
    drawn = sweeps.points(sweeps.SweepSpec(grid=grid, random=4, seed=3))
    assert drawn == sweeps.points(sweeps.SweepSpec(grid=grid, random=4, seed=3))  # the seed decides
    assert len({tuple(p.params.values()) for p in drawn}) == 4
    assert {tuple(p.params.items()) for p in drawn} <= {tuple(p.params.items()) for p in every}
    with pytest.raises(Exception, match="listed twice"):
        sweeps.parse_grid(["seed=1,1"])


def test_a_run_directory_has_one_writer(tmp_path):
    from baseten_loops_cli.training.experiments.rundir import RunDir, RunDirBusy

    first, second = RunDir(tmp_path), RunDir(tmp_path)
    first.acquire()
    assert second.lock_holder() == os.getpid()
    with pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"):
        second.acquire()
    first.release()
    assert second.lock_holder() is None
    second.acquire()
    second.release()
