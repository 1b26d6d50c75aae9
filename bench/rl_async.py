"""Synchronous vs asynchronous RL: the tiny RL example with max_steps_off_policy 0 and 1.

    python bench/rl_async.py [--steps N] [--rounds R] [--json]

Runs examples/tiny-rl.yaml as written (24 steps and its final eval; ``--steps`` shortens it)
with ``max_steps_off_policy: 0`` (sample, then train, every step) and ``1`` (the next batch is
sampled while this one trains), alternating the order each round, against a private server
with production timings. Prints wall(async) / wall(sync), best of ``--rounds`` each; target
<= 0.85.

Overlap pays on one CPU server because the server samples and trains on two threads (the
sampler on the base model's twin, ``local/engine/registry.py``) and splits the torch threads
between them while both are busy (``local/server/compute.ModelWorker``).

Where the time goes (2026-12-05, bf16, server instrumented per sample batch): synchronous,
24 steps sample for 3.5 s (the engine 105 ms a batch of 8 prompts x 8 samples x 8 tokens, the
batching window 11 ms, HTTP and the client the rest) and train for ~2.7 s; asynchronous, the
steps are sampling-bound (4.8 of 5.2 s), the engine slower (133 ms) while training shares the
cores and the GIL. So what shortens sampling shows here: adapter loads refilled in place,
the twin without the trainer's cast hooks, and the tiny model trained in one backward chunk
(run_all 0.98 before them; 0.91 with the chunk change alone; with all three 0.83, 0.84 and
0.75 run alone on a quiet machine, but 0.92 inside run_all at 13:00 UTC: a 6-second run
swings by a second with the machine's load, so each mode is now timed three times, not twice).

Traced again on 2026-12-06 (server jobs and client phases timestamped; the ratio had read
0.856-0.96): asynchronous steps were bound by whichever of sampling and training ended last,
and three things lengthened both beside each other. The training job started a few ms before
the sample job and kept both cores beside it (forward_backward 201-273 ms against 112 alone):
a running job now decides its threads again between decoder layers (engine/thread_budget.py).
The 8 sample requests of a batch reached the busy server over up to 47 ms, so the 10 ms window
split one batch in four into two engine calls, the second after the first: the window now
restarts with each arrival (server/samplers.SampleBatcher). And each of the 64 rewards of a
batch started a thread (14 ms a batch): they now reuse parked threads (rewards/isolation.py).
After that change the ratio read 0.825 and 0.809 alone and 0.894 inside run_all, best of 3:
three runs of 7-10 s do not resolve a 0.03 gain on this machine, so each mode now runs 5 times.

A faster sampler moves this ratio the wrong way: both modes are CPU-bound on two cores, so
what the engine saves shortens the synchronous run by all of it and the overlapped one by
about half. Vectorised draws (one inverse-CDF step for every row instead of a multinomial per
row; branch wip-vectorised-draws, 2026-12-05) took sync from 6.4 to 5.5 s and async from 5.4
to 5.1 s, the ratio from 0.84 to 0.93.
"""

from __future__ import annotations

import argparse
import json
import time

from _common import ROOT, loops, private_server
from train_throughput import SERVER_OPTIONS, emit

TARGET = 0.85


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="max_steps (default: the example's 24)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each mode (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object for run_all.py")
    args = parser.parse_args()
    config = str(ROOT / "examples" / "tiny-rl.yaml")
    walls: dict[int, list[float]] = {0: [], 1: []}
    rewards: dict[int, float] = {}
    with private_server(**SERVER_OPTIONS) as ctx:
        env = ctx["env"]
        steps = ["--set", f"max_steps={args.steps}"] if args.steps else []
        loops(env, "train", "run", config, "--run-dir", str(ctx["tmp"] / "warm"), "--set", "max_steps=1",
              "--set", "data.eval_prompts=null")
        for r in range(args.rounds):
            for bound in ((0, 1) if r % 2 == 0 else (1, 0)):  # alternate, to spread machine noise
                run_dir = ctx["tmp"] / f"run-{bound}-{r}"
                started = time.monotonic()
                loops(env, "train", "run", config, "--run-dir", str(run_dir), *steps,
                      "--set", f"max_steps_off_policy={bound}")
                walls[bound].append(time.monotonic() - started)
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                rewards[bound] = [x["reward"] for x in records if "reward" in x][-1]
                if not args.json:
                    print(f"  max_steps_off_policy={bound}: {walls[bound][-1]:.1f}s, last reward {rewards[bound]:.3f}")
    sync, asyn = min(walls[0]), min(walls[1])
    emit("rl_async", asyn / sync, TARGET,
         f"sync {sync:.1f}s, async {asyn:.1f}s (best of {args.rounds} each); last train reward "
         f"sync {rewards[0]:.3f}, async {rewards[1]:.3f}", args.json, higher_is_better=False)


if __name__ == "__main__":
    main()
