"""The training loops keep the trainer busy: step N+1 is submitted before step N's results are
awaited, while every op still runs in the order of a one-at-a-time loop (training/loop/pipeline.py).

The loop runs in process against the real local server; the trainer client is only observed
(each submit and each first wait is logged, then the real method runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_support import loops

pytest.importorskip("torch")
pytestmark = pytest.mark.local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def trainer_calls(monkeypatch) -> list[tuple[str, str, int]]:
    from baseten_loops_cli.workers.trainer import OpFuture, TrainerClient

    calls: list[tuple[str, str, int]] = []
    submit, result = TrainerClient._submit, OpFuture.result

    def logged_submit(self, op, body, result_type):
        future = submit(self, op, body, result_type)
        calls.append(("submit", op, future.seq_id))
        return future

    def logged_result(self, timeout=None):
        if not self.done():
            calls.append(("wait", self.op, self.seq_id))
        return result(self, timeout)

    monkeypatch.setattr(TrainerClient, "_submit", logged_submit)
    monkeypatch.setattr(OpFuture, "result", logged_result)
    return calls


def test_sft_submits_the_next_step_before_waiting_and_keeps_the_op_order(local_server, tmp_path, trainer_calls):
    run_dir = tmp_path / "run"
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-sft.yaml"), "--run-dir", str(run_dir),
                   "--set", "max_steps=6", "--set", "eval_every=3", "--set", "checkpointing.save_every=2")
    assert result.code == 0, result.stderr
    submits = [(op, seq) for kind, op, seq in trainer_calls if kind == "submit"]
    ops = [op for op, _ in submits]
    # Program order of an unpipelined loop: each eval and save sits right behind its step's
    # optim_step, so it sees exactly that step's weights.
    n_eval = ops.count("forward") // 2  # eval batches, after steps 3 and 6
    step = ["forward_backward", "optim_step"]
    evals = ["forward"] * n_eval
    save = ["save_state", "save_weights_for_sampler"]
    expected = step + step + save + step + evals + step + save + step + step + evals + save
    assert n_eval >= 1 and ops == expected, ops
    assert [seq for _, seq in submits] == sorted(seq for _, seq in submits)
    # Pipelining: step k+1's forward_backward is submitted before step k's results are awaited.
    fb_seqs = [seq for op, seq in submits if op == "forward_backward"]
    position = {(kind, seq): i for i, (kind, _, seq) in enumerate(trainer_calls)}
    for this, following in zip(fb_seqs, fb_seqs[1:]):
        assert position[("submit", following)] < position[("wait", this)], trainer_calls
    # The records are those of a one-at-a-time loop.
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("final")] == [1, 2, 3, 4, 5, 6]
    assert [("eval_loss" in r) for r in records if not r.get("final")] == [False, False, True, False, False, True]
    ckpts = [json.loads(l)["name"] for l in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert ckpts == ["step-000002", "step-000004", "final"]


def test_async_rl_with_two_steps_off_policy_never_trains_staler_groups(local_server, tmp_path):
    run_dir = tmp_path / "async2"
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-rl.yaml"), "--run-dir", str(run_dir),
                   "--set", "max_steps=5", "--set", "groups_per_batch=4", "--set", "group_size=4",
                   "--set", "data.eval_prompts=null", "--set", "max_steps_off_policy=2")
    assert result.code == 0, result.stderr
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(0 <= r["staleness"] <= 2 for r in records), [r["staleness"] for r in records]
    assert any(r["staleness"] == 2 for r in records)  # two batches really were sampled ahead
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        assert sample["step"] - 1 - sample["policy_version"] <= 2  # every group within the bound
