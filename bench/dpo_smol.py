#!/usr/bin/env python
"""DPO on SmolLM2-135M-Instruct (examples/smol-dpo.yaml): held-out preference accuracy before
and after training, on a private local server. Not run in CI (minutes on CPU).

    python bench/dpo_smol.py [--quick] [--check]

Before training the policy is its own reference, so preference accuracy is 0.5; the target is
a clear improvement: >= 0.8 on the 40 held-out pairs after one epoch (20 steps; --quick: 10).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import ROOT, loops, print_ratio
from train_throughput import SMOLLM2, bench_server

TARGET = 0.8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10 steps instead of 20")
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    args = parser.parse_args()
    with bench_server() as server, tempfile.TemporaryDirectory(prefix="loops-dpo-bench-") as tmp:
        env = {**server.env, "LOOPS_NO_AUTOSTART": "1", "NO_COLOR": "1"}
        loops(env, "server", "pull-model", SMOLLM2)
        run_dir = Path(tmp) / "run"
        extra = ["--set", "max_steps=10", "--set", "eval_every=5"] if args.quick else []
        started = time.monotonic()
        loops(env, "train", "run", str(ROOT / "examples" / "smol-dpo.yaml"), "--run-dir", str(run_dir), "--yes", *extra)
        elapsed = time.monotonic() - started
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval_preference_accuracy" in r]
    before, after = evals[0], evals[-1]
    steps = [r for r in records if "loss" in r]
    print_ratio(
        "smol DPO held-out preference accuracy",
        after["eval_preference_accuracy"],
        f">= {TARGET}",
        f"{before['eval_preference_accuracy']:.2f} at step 0 -> {after['eval_preference_accuracy']:.2f} at step {after['step']}; "
        f"eval loss {before['eval_loss']:.3f} -> {after['eval_loss']:.3f}, reward margin {after['eval_reward_margin']:.2f}; "
        f"train loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}; {elapsed:.0f}s",
    )
    return 1 if args.check and after["eval_preference_accuracy"] < TARGET else 0


if __name__ == "__main__":
    raise SystemExit(main())
