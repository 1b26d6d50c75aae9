#!/usr/bin/env python
"""A server that has run RL trains SFT as fast as a fresh one: SFT step time on a server after
an RL run / on a fresh server, side by side in one invocation.

    python bench/after_rl.py [--quick] [--json] [--rl-steps N] [--rounds R] [--steps S]

Two private servers with production timings (``train_throughput.SERVER_OPTIONS``, the default
dtype): on one, ``loops train run examples/smol-rl.yaml`` for ``--rl-steps`` steps (sampling
on the sample lane while the trainer steps, so both lanes ran at once and split the torch
threads); the other is fresh. Then a new SmolLM2 LoRA run on each trains the same SFT batch
(8 datums of 16 to 64 tokens, every target trained) through ``TrainerClient``, one warm-up step
each, then ``--rounds`` alternating rounds of ``--steps`` steps. Prints the median step time
after RL over the fresh server's; target <= 1.05 (issue 33: 2.26 s against 1.80 once).

The detail line gives both servers' thread counts and the CPU share of their two busiest
threads during the SFT rounds (a compute lane and its OpenMP worker near 100% each on a
server that trains at full speed). Full run about 1 minute on 2 cores; ``--quick`` about 40 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, loops
from train_throughput import (
    SMOLLM2,
    HttpTrainer,
    bench_env,
    bench_precision,
    bench_server,
    emit,
    make_batch,
    wire_data,
)

TARGET = 1.05


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return found


def busiest(before: dict[int, float], after: dict[int, float], wall: float, top: int = 2) -> str:
    shares = sorted(((after[t] - before.get(t, 0.0)) / wall for t in after), reverse=True)
    return "/".join(f"{100 * s:.0f}%" for s in shares[:top])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter RL run and fewer rounds")
    parser.add_argument("--json", action="store_true", help="one JSON object for run_all.py")
    parser.add_argument("--rl-steps", type=int, help="RL steps before measuring (default 3; --quick 2)")
    parser.add_argument("--rounds", type=int, help="alternating SFT rounds (default 6; --quick 3)")
    parser.add_argument("--steps", type=int, default=2, help="SFT steps per round per server")
    args = parser.parse_args()
    rl_steps = args.rl_steps or (2 if args.quick else 3)
    rounds = args.rounds or (3 if args.quick else 6)
    bench_env()
    from baseten_loops_cli.local.engine.model_zoo import model_info

    started = time.monotonic()
    with bench_server() as fresh, bench_server() as used, \
            tempfile.TemporaryDirectory(prefix="loops-after-rl-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_"))}
        env.update(used.env, LOOPS_NO_AUTOSTART="1", NO_COLOR="1")
        loops(env, "server", "pull-model", SMOLLM2)
        rl_started = time.monotonic()
        loops(env, "train", "run", str(ROOT / "examples" / "smol-rl.yaml"), "--yes",
              "--run-dir", str(Path(tmp) / "rl"), "--set", f"max_steps={rl_steps}",
              "--set", "data.eval_prompts=null")
        rl_s = time.monotonic() - rl_started
        seqs = make_batch(int(model_info(SMOLLM2).vocab_size), 8, 64)
        sides = {"fresh": HttpTrainer(fresh, SMOLLM2, 16, seqs),
                 "after_rl": HttpTrainer(used, SMOLLM2, 16, seqs)}
        pids = {"fresh": fresh.pid, "after_rl": used.pid}
        try:
            for side in sides.values():
                side.data = wire_data(seqs)
                side.steps(1)  # warm-up: the run's adapter, first-call allocations
            times: dict[str, list[float]] = {name: [] for name in sides}
            threads: dict[str, list[str]] = {name: [] for name in sides}
            for r in range(rounds):
                for name in (("fresh", "after_rl") if r % 2 == 0 else ("after_rl", "fresh")):
                    cpu0, t0 = thread_cpu(pids[name]), time.perf_counter()
                    sides[name].steps(args.steps)
                    wall = time.perf_counter() - t0
                    times[name].append(wall / args.steps)
                    threads[name].append(busiest(cpu0, thread_cpu(pids[name]), wall))
                print(f"round {r + 1}/{rounds}: fresh {times['fresh'][-1]:.3f} s/step "
                      f"({threads['fresh'][-1]}), after RL {times['after_rl'][-1]:.3f} s/step "
                      f"({threads['after_rl'][-1]})", file=sys.stderr, flush=True)
            counts = {name: len(list(Path(f"/proc/{pid}/task").iterdir())) for name, pid in pids.items()}
        finally:
            for side in sides.values():
                side.close()
    fresh_s, used_s = statistics.median(times["fresh"]), statistics.median(times["after_rl"])
    emit("sft_after_rl", used_s / fresh_s, TARGET,
         f"SmolLM2 SFT {used_s:.3f} s/step after {rl_steps} steps of smol-rl.yaml ({rl_s:.0f} s) "
         f"vs {fresh_s:.3f} fresh (median of {rounds} alternating rounds x {args.steps} steps, "
         f"8 datums of 16-64 tokens, {bench_precision().dtype}); server threads "
         f"{counts['after_rl']} vs {counts['fresh']}; two busiest threads' CPU "
         f"{threads['after_rl'][-1]} vs {threads['fresh'][-1]}; "
         f"{time.monotonic() - started:.0f} s in all",
         args.json, higher_is_better=False)


if __name__ == "__main__":
    main()
