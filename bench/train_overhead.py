"""Client and protocol overhead of `loops train run`.

Runs an SFT example against a private local server and compares the command's wall time with
the trainer's own compute time for the same run (the server's per-run compute_seconds):
the tiny example for 40 steps (target <= 1.11: overhead = 1 - compute/wall <= 10%) and the
SmolLM2 example for 10 steps (target <= 1.05).

    python bench/train_overhead.py [--model tiny|smollm2|both] [--steps N] [--json]

The wall time is the whole command: process start, imports, run creation, the steps, the final
checkpoint and the run's deactivation.

The server runs with production timings (``train_throughput.SERVER_OPTIONS``), not the test
fixture's: the fixture snapshots the live state after every op, which is test-only work.

Where the overhead went (2026-12-04, main at 74304bb, quiet machine: 8.2 s wall vs 2.5 s of
compute, ratio 3.25). cProfile of the client: 7.2 of its 8.1 s in ``socket.recv``, and every
request - submit, poll, even a GET - took 44 ms on 127.0.0.1. The server's listening socket was
created with protocol 0, and asyncio disables Nagle's algorithm only on sockets that say
IPPROTO_TCP; each response (headers, then body) waited for the client's 40 ms delayed ACK.
With TCP_NODELAY (``local/daemon.listen``) the same run took 2.7 s (ratio 1.19).

What is left (2026-12-04, main at 8a5d89c: 3.51 s wall vs 2.96 s of compute, ratio 1.19), on the
tiny run's timeline (T = process start): interpreter start and imports until the first request at
~0.35 s (a bare process that imports Typer, httpx and pydantic and builds one model already takes
0.25-0.29 s of CPU here; asyncio is no longer imported by sync commands); the run created at
~0.39 s, its LoRA adapter made by the server's deploy job (~50 ms, PEFT's inject_adapter, not
counted as compute); then steps back to back (the compute lane is idle ~40 ms in all between the
run's 84 jobs: each op's end is one SQLite commit, its result encoded once); the final checkpoint,
deactivation and exit ~40 ms. So the tiny run's overhead is Python start-up; a SmolLM2 run
amortises it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import ROOT, loops
from train_throughput import SMOLLM2, bench_server, emit

# model -> (config, steps, target)
CASES = {
    "tiny": (ROOT / "examples" / "tiny-sft.yaml", 40, 1.11),
    "smollm2": (ROOT / "examples" / "smol-sft.yaml", 10, 1.05),
}


def measure(server, config, steps: int) -> tuple[float, float]:
    """(wall seconds of `loops train run`, the run's trainer compute seconds)."""
    env = {**server.env, "LOOPS_NO_AUTOSTART": "1", "NO_COLOR": "1"}
    no_eval = ["--set", "data.eval=null", "--set", "eval_every=0"]
    with tempfile.TemporaryDirectory(prefix="loops-overhead-") as tmp:
        # Warm the model once so loading it is not counted against the client.
        loops(env, "train", "run", str(config), "--run-dir", f"{tmp}/warm", "--set", "max_steps=1", *no_eval)
        run_dir = Path(tmp) / "run"
        started = time.monotonic()
        loops(env, "train", "run", str(config), "--run-dir", str(run_dir), "--set", f"max_steps={steps}", *no_eval,
              "--set", "checkpointing.save_every=0")
        wall = time.monotonic() - started
        run_id = json.loads((run_dir / "state.json").read_text())["run_id"]
    with server.client() as http:
        usage = http.get("/v1/local/usage", params={"run_id": run_id}).json()["usage"]
    return wall, sum(u.get("compute_seconds", 0.0) for u in usage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2", "both"], default="both")
    parser.add_argument("--steps", type=int, help="steps per run (default: 40 tiny, 10 SmolLM2)")
    parser.add_argument("--json", action="store_true", help="one JSON object for run_all.py")
    args = parser.parse_args()
    models = ["tiny", "smollm2"] if args.model == "both" else [args.model]
    results = []
    with bench_server() as server:
        if "smollm2" in models:
            loops({**server.env, "LOOPS_NO_AUTOSTART": "1"}, "server", "pull-model", SMOLLM2)
        for model in models:
            config, steps, target = CASES[model]
            steps = args.steps or steps
            wall, compute = measure(server, config, steps)
            ratio = wall / compute if compute else float("inf")
            detail = (f"wall {wall:.2f}s vs trainer compute {compute:.2f}s over {steps} steps of "
                      f"{config.name}; overhead {1.0 - compute / wall:.1%}")
            results.append((f"train_overhead[{model}]", ratio, target, detail))
    if args.json:
        print(json.dumps({"results": [
            {"case": name, "ratio": round(ratio, 4), "target": target, "op": "<=", "ok": ratio <= target,
             "detail": detail} for name, ratio, target, detail in results]}))
        return
    for name, ratio, target, detail in results:
        emit(name, ratio, target, detail, False, higher_is_better=False)


if __name__ == "__main__":
    main()
