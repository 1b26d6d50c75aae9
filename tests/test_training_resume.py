"""`loops train resume` after the run was deactivated: a new run, said so, its lineage in
state.json and in `loops runs describe`; a Ctrl-C during the last step is honoured like any other;
state.json's run_status is the backend's own word for the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _loops(server, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "WANDB_"))}
    env.update(server.env, NO_COLOR="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_ctrl_c_at_the_last_step_then_resume_in_a_new_run_with_lineage(local_server, tmp_path, monkeypatch):
    from baseten_loops_cli.training.service import absolute_raw
    from baseten_loops_cli.cli._backend import open_backend
    from baseten_loops_cli.training.config import load_config
    from baseten_loops_cli.training.experiments.metrics import MetricsSink
    from baseten_loops_cli.training.plan import load_data
    from baseten_loops_cli.training.experiments.rundir import RunDir
    from baseten_loops_cli.training.session import StopRequested, open_session
    from baseten_loops_cli.training.kinds import LoadedData
    from baseten_loops_cli.training.kinds.sft import SFTSteps
    from baseten_loops_cli.training.loop.core import run

    for key, value in local_server.env.items():
        monkeypatch.setenv(key, value)
    loaded = load_config(EXAMPLES / "tiny-sft.yaml", ["max_steps=2", "eval_every=0", "data.eval=null"])
    data = load_data(loaded)
    rundir = RunDir(tmp_path / "run")
    rundir.create(absolute_raw(loaded), loaded.path)
    backend = open_backend()
    session = open_session(loaded, rundir, backend, resume=False, announce=lambda _: None)
    stop = StopRequested()  # not entered: no signal handler; the "Ctrl-C" is set below

    class CtrlCDuringLastStep(MetricsSink):
        def step(self, record: dict) -> None:
            super().step(record)
            if record["step"] == 2:
                stop.requested = True  # what the SIGINT handler does, during the last step

    status = run(SFTSteps(session, LoadedData(data.tokenizer, data.train, None)), CtrlCDuringLastStep(rundir), stop)
    assert status == "interrupted"  # -> exit 130 in `loops train run`, like any other step
    assert rundir.last_checkpoint()["step"] == 2 and rundir.last_checkpoint()["name"] != "final"
    rundir.update_state(status=status)
    session.close(deactivate=True)  # what `loops train run` does at the end
    old_run = session.run_id

    resumed = _loops(local_server, "train", "resume", str(rundir.path))
    assert resumed.returncode == 0, resumed.stderr
    assert f"Run {old_run} is no longer active: continuing in the new run" in resumed.stderr
    state = json.loads(rundir.state_file.read_text())
    assert state["run_id"] != old_run and state["resumed_from"] == [old_run]
    assert state["status"] == "completed" and state["run_status"] == "INACTIVE"
    assert [r["step"] for r in rundir.metrics()] == [1, 2]  # nothing repeated
    assert rundir.last_checkpoint()["name"] == "final"

    described = _loops(local_server, "runs", "describe", state["run_id"])
    assert described.returncode == 0, described.stderr
    assert any(line.split() == ["Resumed", "From:", old_run] for line in described.stdout.splitlines()), described.stdout
    listed = _loops(local_server, "runs", "list", "--all", "-o", "json")
    row = next(r for r in json.loads(listed.stdout)["runs"] if r["id"] == state["run_id"])
    assert row["status"]["name"] == state["run_status"]  # one vocabulary: the backend's
