"""Synchronous vs asynchronous RL: the tiny RL example with max_steps_off_policy 0 and 1.

    python bench/rl_async.py [--steps N]

Prints wall(async) / wall(sync). Below 1.0 means overlapping sampling with training pays; on a
2-core CPU, sampler and trainer share the same cores, so expect about 1.0 there.
"""

from __future__ import annotations

import argparse
import json
import time

from _common import ROOT, loops, print_ratio, private_server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    config = str(ROOT / "examples" / "tiny-rl.yaml")
    walls = {}
    with private_server() as ctx:
        env = ctx["env"]
        common = ["--set", f"max_steps={args.steps}", "--set", "data.eval_prompts=null"]
        loops(env, "train", "run", config, "--run-dir", str(ctx["tmp"] / "warm"), "--set", "max_steps=1",
              "--set", "data.eval_prompts=null")
        for bound in (0, 1, 0, 1):  # alternate, to spread machine noise over both
            run_dir = ctx["tmp"] / f"run-{bound}-{time.monotonic_ns()}"
            started = time.monotonic()
            loops(env, "train", "run", config, "--run-dir", str(run_dir), *common,
                  "--set", f"max_steps_off_policy={bound}")
            walls.setdefault(bound, []).append(time.monotonic() - started)
            rewards = [json.loads(l).get("reward") for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
            print(f"  max_steps_off_policy={bound}: {walls[bound][-1]:.1f}s, last reward {rewards[-1]:.3f}")
    sync, asyn = min(walls[0]), min(walls[1])
    print_ratio("rl_async", asyn / sync, "< 1.0 where sampling and training can overlap",
                f"sync {sync:.1f}s, async {asyn:.1f}s (best of 2 each)")


if __name__ == "__main__":
    main()
