"""Client and protocol overhead of `loops train run`.

Runs the tiny SFT example against a private local server and compares the command's wall time
with the trainer's own compute time for the same run (the server's per-run compute_seconds).

    python bench/train_overhead.py [--steps N]

Prints the ratio wall / trainer compute (target <= 1.11: overhead = 1 - compute/wall <= 10%).

The server runs with production timings (``train_throughput.SERVER_OPTIONS``), not the test
fixture's: the fixture snapshots the live state after every op, which is test-only work.

Profile (py-spy, 50 Hz, ``--subprocesses``, 15 steps, main at e912b5c, before the pipelined
loops; load average 15 on 2 cores), the server's busy samples (idle waits and the one-time
model import/load excluded), inclusive:

     72.5% ModelWorker._loop            compute thread
     57.6% LoraTrainer.forward_backward  trainer.py (forward 36.6%, backward 19.2%)
      9.3% save_live_state               the fixture's snapshot after every op (test timings)
      7.1% TokenAuthMiddleware/FaultMiddleware  per request, event loop
      4.6% _janitor                      SamplerService.sweep -> Store.list_samplers 4.1%,
                                         OperationRegistry.expire 2.4% (every 0.2 s)
      3.7% LoraTrainer.optim_step
      1.7% Store.get_run                 once per request
      1.5% trainer_routes._run

The ``loops train run`` process was busy for only 119 samples (~2.4 s; 38% of them imports,
25% creating the backend client): it spent the run blocked in polls, and with one step in flight
the compute thread idled for each client round trip (poll answer, record, build, submit) -
what the pipelined loops (training/pipeline.py) remove.
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
    from train_throughput import SERVER_OPTIONS

    with private_server(**SERVER_OPTIONS) as ctx:
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
