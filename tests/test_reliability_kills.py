"""`loops train` SIGKILLed at random points, then `loops train resume`: the same step count and
the same final adapter as an uninterrupted run, and every step in metrics.jsonl exactly once.

LOOPS_KILL_POINTS (default 5) kills per test; LOOPS_KILL_SEED picks the points.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.cli_support import kill_once_then_resume, start_loops, trained_steps  # noqa: E402
from tests.support import cli_env, kill, wait_for  # noqa: E402
from tests.test_reliability_faults import (  # noqa: E402
    adapter_tensors,
    assert_same_adapter,
    loops,
    run_dir_result,
    sft_config,
)

KILL_POINTS = int(os.environ.get("LOOPS_KILL_POINTS", "5"))
KILL_SEED = int(os.environ.get("LOOPS_KILL_SEED", "20261203"))
STEPS = int(os.environ.get("LOOPS_KILL_STEPS", "12"))
ROOT = Path(__file__).resolve().parent.parent


def _command(config: Path, run_dir: Path) -> list[str]:
    if (run_dir / "state.json").exists():
        return ["train", "resume", str(run_dir)]
    return ["train", "run", str(config), "--run-dir", str(run_dir)]


def _final_policy_version(server, run_id: str, name: str) -> int | None:
    with server.client() as c:
        cps = c.get("/v1/loops/checkpoints", params={"run_id": run_id}).json()["checkpoints"]
    cp = next((x for x in cps if x["checkpoint_id"] == name and x["target"] == "sampler"), None)
    return None if cp is None else cp.get("policy_version")


@pytest.mark.slow
def test_train_killed_at_random_points_then_resumed(local_server, tmp_path):
    config = sft_config(tmp_path, steps=STEPS, save_every=2, seed=5)
    env = cli_env(local_server)

    t0 = time.monotonic()
    clean = loops(["train", "run", str(config), "--run-dir", str(tmp_path / "clean")], env, tmp_path)
    clean_s = time.monotonic() - t0
    assert clean.returncode == 0, clean.stderr

    rng = random.Random(KILL_SEED)
    run_dir = tmp_path / "killed"
    kills: list[str] = []
    for _ in range(KILL_POINTS):
        done_before = len(trained_steps(run_dir))
        # A kill point: a random moment of the run's life, from start-up to the last steps.
        delay = rng.uniform(0.3, max(0.6, clean_s * 0.9))
        proc = start_loops(_command(config, run_dir), env, tmp_path)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            kill(proc, group=True, timeout=60)
        else:  # it finished before the kill point
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            break
        done_after = len(trained_steps(run_dir))
        kills.append(f"after {delay:.2f}s (steps on disk {done_before} -> {done_after})")
    final = loops(_command(config, run_dir), env, tmp_path) if (run_dir / "state.json").exists() else None
    if final is not None and "already completed" not in (final.stdout + final.stderr):
        assert final.returncode == 0, final.stderr
    print(f"\n{len(kills)} SIGKILLs survived: " + "; ".join(kills))

    clean_steps, clean_run, clean_name = run_dir_result(tmp_path / "clean")
    steps, run_id, name = run_dir_result(run_dir)
    assert json.loads((run_dir / "state.json").read_text())["status"] == "completed"
    assert steps == clean_steps == STEPS
    trained = trained_steps(run_dir)
    assert trained == list(range(1, STEPS + 1)), f"steps in metrics.jsonl: {trained}"
    assert _final_policy_version(local_server, run_id, name) in (STEPS, None)
    assert_same_adapter(adapter_tensors(local_server, clean_run, clean_name),
                        adapter_tensors(local_server, run_id, name))


def test_train_killed_once_mid_run_then_resumed(local_server, tmp_path):
    """The fast variant for every test run: one SIGKILL after the first checkpoint."""
    config = sft_config(tmp_path, steps=6, save_every=2, seed=9)
    kill_once_then_resume(local_server, config, tmp_path, steps=6)
