"""Client and protocol overhead of `loops train run`.

Runs the tiny SFT example against a private local server and compares the command's wall time
with the trainer's own compute time for the same run (the server's per-run compute_seconds).

    python bench/train_overhead.py [--steps N]

Prints the ratio wall / trainer compute (target <= 1.11: overhead = 1 - compute/wall <= 10%).
"""

from __future__ import annotations

import argparse
import json
import time

from _common import ROOT, loops, print_ratio, private_server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny-sft.yaml"))
    args = parser.parse_args()
    with private_server() as ctx:
        env = ctx["env"]
        # Warm the model once so loading it is not counted against the client.
        loops(env, "train", "run", args.config, "--run-dir", str(ctx["tmp"] / "warm"), "--set", "max_steps=1",
              "--set", "data.eval=null", "--set", "eval_every=0")
        run_dir = ctx["tmp"] / "run"
        started = time.monotonic()
        loops(env, "train", "run", args.config, "--run-dir", str(run_dir), "--set", f"max_steps={args.steps}",
              "--set", "data.eval=null", "--set", "eval_every=0", "--set", "checkpointing.save_every=0")
        wall = time.monotonic() - started
        run_id = json.loads((run_dir / "state.json").read_text())["run_id"]
        with ctx["server"].client() as http:
            usage = http.get("/v1/local/usage", params={"run_id": run_id}).json()["usage"]
        compute = sum(u.get("compute_seconds", 0.0) for u in usage)
    ratio = wall / compute if compute else float("inf")
    overhead = 1.0 - compute / wall
    print_ratio("train_overhead", ratio, "<= 1.11, i.e. client overhead <= 10% of wall time",
                f"wall {wall:.1f}s vs trainer step time {compute:.1f}s over {args.steps} steps; "
                f"overhead {overhead:.1%} (wall includes process start and the final checkpoint)")


if __name__ == "__main__":
    main()
