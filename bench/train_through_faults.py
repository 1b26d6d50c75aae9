"""Wall time of `loops train run` through 20% transport faults vs the same run without.

Runs the same tiny SFT config (fixed seed) twice against a private local server: once
directly, once with ``LOOPS_BASE_URL`` pointing at the fault proxy of the reliability tests
(tests/faultproxy.py: resets, lost responses, 502/503, 408s, 0.2 s delays, replays at
``--rate``). tests/test_reliability_faults.py checks that both runs end with the same steps
and the same adapter; this bench measures what the retries cost.

    python bench/train_through_faults.py [--steps N] [--rate 0.2] [--seed 1234] [--quick]

Prints the client's time beyond the faults' own waits, per 10 faults (target <= 1.0 s):
(faulty wall - clean wall - faults' own waits) / faults * 10. The faults' own waits are what
the proxy imposed whatever the client does (each Retry-After it sent, honoured as the protocol
asks, and each slow response's delay; ``FaultProxy.snapshot()["imposed_s"]``); what is left is
the client's retries: the re-sent requests and any backoff. Also printed: faulty / clean.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import ROOT, loops, print_ratio, private_server

TARGET = 1.0  # seconds of client time beyond the faults' own waits, per 10 faults
DELAY_S = 0.2  # a slow response's delay
RETRY_AFTER_S = 1  # the Retry-After of a 502/503 that carries one


def sft_config(folder: Path, steps: int) -> Path:
    path = folder / "sft.yaml"
    path.write_text(
        "kind: sft\nname: faults-bench\nbase_model: loops-local/tiny\nlora_rank: 4\nmax_seq_len: 64\n"
        f"seed: 3\nbatch_size: 4\nmax_steps: {steps}\noptimizer:\n  learning_rate: 3.0e-3\n"
        f"checkpointing:\n  save_every: 2\ndata:\n  train: {ROOT / 'examples' / 'data' / 'tiny_sft_train.jsonl'}\n",
        encoding="utf-8")
    return path


def timed_run(env: dict, config: Path, run_dir: Path) -> tuple[float, int]:
    """(wall seconds, steps trained) of one `loops train run`."""
    started = time.monotonic()
    loops(env, "train", "run", str(config), "--run-dir", str(run_dir))
    seconds = time.monotonic() - started
    steps = json.loads((run_dir / "state.json").read_text())["step"]
    return seconds, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rate", type=float, default=0.2, help="fraction of requests that get a fault")
    parser.add_argument("--seed", type=int, default=1234, help="the fault proxy's seed")
    parser.add_argument("--pairs", type=int, default=3,
                        help="clean/faulty pairs, alternating; the median pair is reported (one pair's "
                        "figure varies with the backoff's jitter and the server's own pauses)")
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 pair (for bench/run_all.py --quick)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.pairs = 4, 1

    from tests.faultproxy import FaultProxy

    pairs = []  # (client seconds per 10 faults, clean s, faulty s, proxy snapshot)
    with private_server() as ctx:
        env, tmp, server = {**ctx["env"], "LOOPS_NO_AUTOSTART": "1"}, ctx["tmp"], ctx["server"]
        config = sft_config(tmp, args.steps)
        # Warm the model and the server's first-run paths, so neither side pays for them.
        loops(env, "train", "run", str(config), "--run-dir", str(tmp / "warm"), "--set", "max_steps=1")
        port = int(server.url.rsplit(":", 1)[1])
        for i in range(args.pairs):
            clean_s, clean_steps = timed_run(env, config, tmp / f"clean-{i}")
            # The same seed each time: the same faults, in the same order of requests.
            with FaultProxy("127.0.0.1", port, rate=args.rate, seed=args.seed, delay_s=DELAY_S,
                            retry_after_s=RETRY_AFTER_S) as proxy:
                faulty_s, faulty_steps = timed_run({**env, "LOOPS_BASE_URL": proxy.url}, config, tmp / f"faulty-{i}")
                snap = proxy.snapshot()
            if clean_steps != faulty_steps:
                raise SystemExit(f"the runs differ: {clean_steps} steps clean, {faulty_steps} through faults")
            # The faults' own waits (each Retry-After sent, each slow response), as the proxy
            # counted them: what any client pays. The rest of the difference is the client's.
            client_s = faulty_s - clean_s - snap["imposed_s"]
            pairs.append((client_s / max(snap["injected"], 1) * 10, clean_s, faulty_s, snap))
    pairs.sort(key=lambda p: p[0])
    per10, clean_s, faulty_s, snap = pairs[len(pairs) // 2]
    kinds = snap["by_kind"]
    print_ratio("train_through_faults", per10, f"<= {TARGET} s per 10 faults",
                f"median of {len(pairs)} pairs ({', '.join(f'{p[0]:.2f}' for p in pairs)}); {args.steps} steps: "
                f"clean {clean_s:.1f}s, through {args.rate:.0%} faults {faulty_s:.1f}s (x{faulty_s / clean_s:.1f}); "
                f"{snap['injected']} faults injected ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); "
                f"{snap['imposed_s']:.1f}s of that is the faults' own waits (Retry-After, slow responses), "
                f"{faulty_s - clean_s - snap['imposed_s']:.2f}s the client's retries")


if __name__ == "__main__":
    main()
