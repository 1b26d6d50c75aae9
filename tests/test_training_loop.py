"""The one training loop (training/loop/core.py): ``max_steps`` wins over ``epochs`` and cycles the
data, in the plan as in the run; and Ctrl-C stops without starting another step.

The loops run against the real local server; the trainer client is only observed (each
submit is logged, then the real method runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_support import loops

pytest.importorskip("torch")
pytestmark = pytest.mark.local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _sft_config(tmp_path: Path, rows: int, extra: str) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} plus one is", "completion": f" {i + 1}"}) + "\n"
                            for i in range(rows)))
    config = tmp_path / "sft.yaml"
    config.write_text("kind: sft\nname: cycle\nbase_model: loops-local/tiny\nlora_rank: 4\nmax_seq_len: 64\n"
                      f"batch_size: 8\nepochs: 1\n{extra}data:\n  train: train.jsonl\n")
    return config


def test_max_steps_wins_over_epochs_and_cycles_the_data(local_server, tmp_path):
    """HF Trainer / TRL: ``max_steps: 20`` on 40 rows, batch 8, epochs 1 trains 20 steps (4
    passes over the 5 batches), and the plan counts the same 20 steps and their tokens."""
    from baseten_loops_cli.training.loop.core import step_rows, total_steps

    config = _sft_config(tmp_path, 40, "max_steps: 20\n")
    plan = loops(local_server, "train", "validate", str(config), "-o", "json")
    assert plan.code == 0, plan
    assert plan.json()["plan"]["steps"] == 20
    run_dir = tmp_path / "run"
    result = loops(local_server, "train", "run", str(config), "--run-dir", str(run_dir), "--yes", "-o", "json")
    assert result.code == 0, result
    assert result.json()["steps"] == 20
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("final")] == list(range(1, 21))
    assert plan.json()["plan"]["train_tokens"] == sum(r["tokens"] for r in records if not r.get("final"))

    class Seeded:
        seed = 0

    assert total_steps(40, 8, 1, None) == 5 and total_steps(40, 8, 1, 20) == 20 and total_steps(40, 8, 9, 3) == 3
    epoch = [sorted(i for s in range(e * 5, e * 5 + 5) for i in step_rows(40, 8, s, Seeded)) for e in range(4)]
    assert all(rows == list(range(40)) for rows in epoch)  # each pass sees every row once


@pytest.fixture
def trainer_submits(monkeypatch) -> list[tuple[str, int]]:
    from baseten_loops_cli.workers.trainer import TrainerClient

    calls: list[tuple[str, int]] = []
    submit = TrainerClient._submit

    def logged_submit(self, op, body, result_type):
        future = submit(self, op, body, result_type)
        calls.append((op, future.seq_id))
        return future

    monkeypatch.setattr(TrainerClient, "_submit", logged_submit)
    return calls


def _ctrl_c_at_step_2(server, tmp_path: Path, monkeypatch, submits: list) -> tuple[object, int]:
    """Run tiny SFT (6 steps) in process and "Ctrl-C" (set the stop flag, what the SIGINT
    handler does) as step 2 is recorded. Returns (run directory, submits before the stop)."""
    from baseten_loops_cli.cli._backend import open_backend
    from baseten_loops_cli.training.config import load_config
    from baseten_loops_cli.training.kinds import LoadedData
    from baseten_loops_cli.training.kinds.sft import SFTSteps
    from baseten_loops_cli.training.loop.core import run
    from baseten_loops_cli.training.experiments.metrics import MetricsSink
    from baseten_loops_cli.training.plan import load_data
    from baseten_loops_cli.training.experiments.rundir import RunDir
    from baseten_loops_cli.training.service import absolute_raw
    from baseten_loops_cli.training.session import StopRequested, open_session

    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    loaded = load_config(EXAMPLES / "tiny-sft.yaml", ["max_steps=6", "eval_every=0", "data.eval=null",
                                                      "checkpointing.save_every=0"])
    data = load_data(loaded)
    rundir = RunDir(tmp_path / "run")
    rundir.create(absolute_raw(loaded), loaded.path)
    session = open_session(loaded, rundir, open_backend(), resume=False, announce=lambda _: None)
    stop = StopRequested()  # not entered: no signal handler
    seen: list[int] = []

    class CtrlCAtStep2(MetricsSink):
        def step(self, record: dict) -> None:
            super().step(record)
            if record["step"] == 2:
                stop.requested = True
                seen.append(len(submits))

    try:
        status = run(SFTSteps(session, LoadedData(data.tokenizer, data.train, None)), CtrlCAtStep2(rundir), stop)
        rundir.update_state(status=status)
    finally:
        session.close(deactivate=True)
    assert status == "interrupted"
    return rundir, seen[0]


def test_ctrl_c_on_long_steps_starts_no_other_step_and_resumes_exactly_once(local_server, tmp_path, monkeypatch,
                                                                            trainer_submits):
    """Steps longer than AHEAD_MAX_STEP_S are not submitted ahead: a Ctrl-C during step 2 stops
    after it, with nothing of step 3 submitted; `train resume` then trains 3..6 once each."""
    from baseten_loops_cli.training.loop import core as loop

    monkeypatch.setattr(loop, "AHEAD_MAX_STEP_S", 0.0)  # every step counts as long
    rundir, before = _ctrl_c_at_step_2(local_server, tmp_path, monkeypatch, trainer_submits)
    after = [op for op, _ in trainer_submits[before:]]
    assert "forward_backward" not in after and "optim_step" not in after, after
    assert after == ["save_state", "save_weights_for_sampler"]  # only the resume point
    assert [op for op, _ in trainer_submits].count("forward_backward") == 2
    assert [r["step"] for r in rundir.metrics()] == [1, 2]
    assert rundir.last_checkpoint()["step"] == 2

    resumed = loops(local_server, "train", "resume", str(rundir.path))
    assert resumed.code == 0, resumed
    assert "Resuming at step 3" in resumed.stderr
    assert [r["step"] for r in rundir.metrics()] == [1, 2, 3, 4, 5, 6]  # nothing repeated or skipped


def test_ctrl_c_on_short_steps_submits_nothing_more(local_server, tmp_path, monkeypatch, trainer_submits):
    """Short steps are pipelined: step 3 was submitted before step 2 was recorded, so it
    finishes (the protocol cannot take it back) and is the resume point; nothing after it is
    submitted."""
    rundir, before = _ctrl_c_at_step_2(local_server, tmp_path, monkeypatch, trainer_submits)
    after = [op for op, _ in trainer_submits[before:]]
    assert after == ["save_state", "save_weights_for_sampler"], after
    assert [op for op, _ in trainer_submits].count("forward_backward") == 3
    assert [r["step"] for r in rundir.metrics()] == [1, 2, 3]
    assert rundir.last_checkpoint()["step"] == 3
