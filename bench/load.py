#!/usr/bin/env python
"""Load on the local server: concurrent training runs + concurrent sampling, measured.

For ``--seconds`` (default 120, or ``LOOPS_LOAD_SECONDS``) it keeps, against one local server
on 127.0.0.1:

* ``--runs`` (4) training runs busy: each a real ``TrainerClient`` doing forward_backward +
  optim_step on a tiny batch, with a save_state every ``--save-every`` steps;
* ``--samplers`` (32) sampling requests in flight at all times (each worker thread sends the
  next ``POST /sample`` as soon as the previous one returns), spread over the runs' samplers;
* ``--pollers`` (2) control-plane readers (list/get runs, samplers, checkpoints, status).

Every HTTP call is bounded (timeouts) and goes to loopback only. At the end it checks that no
operation failed or was lost: each run's ``policy_version`` equals the optimizer steps its
client saw complete, and each saved checkpoint is listed. It reports p50/p99 latency of the
control-plane calls (and of trainer ops and samples) and writes JSON with ``--json``.

    python bench/load.py                       # starts its own server in a temp dir
    python bench/load.py --url URL --token T   # against a running server
    python bench/load.py --quick --json        # 20 s, for bench/run_all.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_SECONDS = 120.0
QUICK_SECONDS = 20.0
MODEL = "loops-local/tiny"
# Targets (ratio = measured / budget; <= 1.0 is ok). Budgets for a 2-core CPU box where
# training and sampling share the cores with the control plane.
CONTROL_P50_BUDGET_MS = 100.0
CONTROL_P99_BUDGET_MS = 1000.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ok: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: list[str] = field(default_factory=list)

    def record(self, kind: str, seconds: float, ok: bool, error: str | None = None) -> None:
        with self.lock:
            self.latencies[kind].append(seconds * 1000.0)
            if ok:
                self.ok[kind] += 1
            else:
                self.failed[kind] += 1
                if error and len(self.errors) < 50:
                    self.errors.append(f"{kind}: {error}")

    def timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - counted, reported
            self.record(kind, time.perf_counter() - t0, False, f"{type(exc).__name__}: {exc}"[:300])
            raise
        self.record(kind, time.perf_counter() - t0, True)
        return out


def _check(resp) -> Any:
    if resp.status_code >= 400:
        raise RuntimeError(f"HTTP {resp.status_code} {resp.request.method} {resp.request.url.path}: {resp.text[:200]}")
    return resp.json() if resp.content else {}


# ── the server ──────────────────────────────────────────────────────────────────────────────


class _OwnServer:
    """A local server in a temp dir, for when no --url is given."""

    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="loops-load-")
        root = Path(self.tmp.name)
        self.state_dir, self.data_dir = root / "state", root / "data"
        self.url = self.token = ""

    def start(self) -> "_OwnServer":
        import socket

        from baseten_loops_cli.local import daemon

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"LOOPS_STATE_DIR": str(self.state_dir), "LOOPS_DATA_DIR": str(self.data_dir),
               "LOOPS_CONFIG_DIR": str(Path(self.tmp.name) / "config"),
               "LOOPS_CACHE_DIR": str(Path(self.tmp.name) / "cache")}
        info = daemon.start(port, state_dir=self.state_dir, data_dir=self.data_dir, env=env, timeout=180)
        self.url = info.url
        self.token = daemon.read_token(self.state_dir) or ""
        return self

    def stop(self) -> None:
        from baseten_loops_cli.local import daemon

        try:
            daemon.stop(self.state_dir)
        finally:
            self.tmp.cleanup()


# ── workloads ───────────────────────────────────────────────────────────────────────────────


def _datum(rng: random.Random, vocab: int, length: int = 12) -> dict:
    toks = [rng.randrange(1, vocab) for _ in range(length + 1)]
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": toks[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": toks[1:], "dtype": "int64", "shape": [length]},
            "weights": {"data": [1.0] * length, "dtype": "float32", "shape": [length]},
        },
    }


@dataclass
class RunState:
    run_id: str
    sampler_url: str | None
    steps_done: int = 0
    saved: list[str] = field(default_factory=list)
    policy_version: int | None = None
    error: str | None = None


def train_worker(url: str, token: str, run: RunState, deadline: float, stats: Stats, vocab: int,
                 save_every: int, seed: int) -> None:
    from baseten_loops_cli.workers.trainer import TrainerClient

    rng = random.Random(seed)
    tc = TrainerClient(f"{url}/trainers/{run.run_id}", api_key=token, run_id=run.run_id, base_model=MODEL,
                       result_timeout=300, submit_timeout=120)
    try:
        while time.monotonic() < deadline:
            batch = [_datum(rng, vocab) for _ in range(2)]
            t0 = time.perf_counter()
            fb = stats.timed("trainer submit", lambda: tc.forward_backward(batch))
            opt = stats.timed("trainer submit", lambda: tc.optim_step({"learning_rate": 1e-3}))
            stats.timed("trainer op result", lambda: fb.result(timeout=300))
            stats.timed("trainer op result", lambda: opt.result(timeout=300))
            stats.record("train step", time.perf_counter() - t0, True)
            run.steps_done += 1
            if save_every and run.steps_done % save_every == 0:
                name = f"load-{run.steps_done}"
                fut = stats.timed("trainer submit", lambda: tc.save_state(name))
                stats.timed("trainer op result", lambda: fut.result(timeout=300))
                run.saved.append(name)
        run.policy_version = tc.policy_version()
    except Exception as exc:  # noqa: BLE001 - reported as a failed run
        run.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        tc.close()


def sample_worker(url: str, token: str, samplers: list[str], deadline: float, stats: Stats, vocab: int,
                  seed: int) -> None:
    import httpx

    rng = random.Random(seed)
    headers = {"Authorization": f"Api-Key {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(120.0, connect=10.0)) as c:
        while time.monotonic() < deadline:
            sampler = samplers[rng.randrange(len(samplers))]
            body = {"prompt": [rng.randrange(1, vocab) for _ in range(8)], "max_tokens": 8, "n": 1,
                    "temperature": 1.0, "seed": rng.randrange(1 << 30)}
            try:
                stats.timed("sample", lambda: _check(c.post(f"{sampler}/sample", json=body)))
            except Exception:  # noqa: BLE001 - counted in stats
                time.sleep(0.1)


def control_worker(url: str, token: str, runs: list[RunState], deadline: float, stats: Stats, seed: int) -> None:
    import httpx

    rng = random.Random(seed)
    headers = {"Authorization": f"Api-Key {token}"}
    calls = [
        lambda c: _check(c.get("/v1/loops/runs")),
        lambda c: _check(c.get(f"/v1/loops/runs/{rng.choice(runs).run_id}")),
        lambda c: _check(c.get("/v1/loops/samplers")),
        lambda c: _check(c.get("/v1/loops/checkpoints", params={"run_id": rng.choice(runs).run_id})),
        lambda c: _check(c.get("/v1/local/status")),
        lambda c: _check(c.get("/v1/local/usage")),
    ]
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(60.0, connect=10.0)) as c:
        while time.monotonic() < deadline:
            call = rng.choice(calls)
            try:
                stats.timed("control plane", lambda: call(c))
            except Exception:  # noqa: BLE001 - counted in stats
                pass
            time.sleep(0.05)


# ── the bench ───────────────────────────────────────────────────────────────────────────────


def run_load(url: str, token: str, *, seconds: float, n_runs: int = 4, n_samplers: int = 32,
             n_pollers: int = 2, save_every: int = 5, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Run the load against ``url``; returns the report dict (see ``main`` for its shape)."""
    import httpx

    stats = Stats()
    headers = {"Authorization": f"Api-Key {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(180.0, connect=10.0)) as c:
        session = stats.timed("control plane", lambda: _check(c.post("/v1/loops/sessions", json={})))["session"]["id"]
        runs: list[RunState] = []
        for i in range(n_runs):
            body = {"session_id": session, "base_model": MODEL, "lora_rank": 4, "seed": seed + i,
                    "name": f"load-{i}"}
            run = stats.timed("control plane", lambda: _check(c.post("/v1/loops/runs", json=body)))["run"]
            sampler = run.get("sampler") or {}
            surl = sampler.get("base_url")
            runs.append(RunState(run["id"], surl))
        samplers = [r.sampler_url for r in runs if r.sampler_url]
        if not samplers:  # no paired samplers in the run view: create them explicitly
            for r in runs:
                s = stats.timed("control plane", lambda: _check(c.post(
                    "/v1/loops/samplers", json={"session_id": session, "run_id": r.run_id})))["sampler"]
                r.sampler_url = s["base_url"]
            samplers = [r.sampler_url for r in runs]
        vocab = 256
        caps = _check(c.get("/v1/loops/capabilities"))
        for m in (caps.get("models") or caps.get("supported_models") or []):
            if isinstance(m, dict) and m.get("name", m.get("model_name")) == MODEL and m.get("vocab_size"):
                vocab = int(m["vocab_size"])
    # Relative sampler URLs are absolute in the run view; strip the origin for the client.
    samplers = [s[len(url):] if s.startswith(url) else s for s in samplers]

    log(f"load: {n_runs} runs, {n_samplers} concurrent samplers, {n_pollers} pollers for {seconds:.0f}s on {url}")
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=train_worker, args=(url, token, r, deadline, stats, vocab, save_every, seed + i),
                                name=f"train-{i}", daemon=True) for i, r in enumerate(runs)]
    threads += [threading.Thread(target=sample_worker, args=(url, token, samplers, deadline, stats, vocab, seed + 100 + i),
                                 name=f"sample-{i}", daemon=True) for i in range(n_samplers)]
    threads += [threading.Thread(target=control_worker, args=(url, token, runs, deadline, stats, seed + 200 + i),
                                 name=f"control-{i}", daemon=True) for i in range(n_pollers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    # Bounded join: everything stops by the deadline plus the longest op timeout.
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()) + 360)
    stuck = [t.name for t in threads if t.is_alive()]
    elapsed = time.monotonic() - t0

    # Verification: no failed or lost operation.
    lost: list[str] = []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        for r in runs:
            if r.error:
                continue
            if r.policy_version != r.steps_done:
                lost.append(f"run {r.run_id}: policy_version {r.policy_version} != {r.steps_done} steps completed")
            listed = {cp.get("checkpoint_id") or cp.get("name") or "" for cp in
                      _check(c.get("/v1/loops/checkpoints", params={"run_id": r.run_id})).get("checkpoints", [])}
            for name in r.saved:
                if not any(name in x for x in listed):
                    lost.append(f"run {r.run_id}: checkpoint {name} not listed")
    failed_ops = sum(stats.failed.values())
    run_errors = [f"{r.run_id}: {r.error}" for r in runs if r.error]

    def lat(kind: str) -> dict:
        v = stats.latencies.get(kind, [])
        return {"count": len(v), "p50_ms": _r(percentile(v, 50)), "p99_ms": _r(percentile(v, 99)),
                "max_ms": _r(max(v) if v else None), "mean_ms": _r(statistics.fmean(v) if v else None)}

    report = {
        "seconds": round(elapsed, 1),
        "runs": n_runs,
        "concurrent_samplers": n_samplers,
        "latency": {k: lat(k) for k in ("control plane", "trainer submit", "trainer op result", "train step", "sample")},
        "ok": dict(stats.ok),
        "failed": dict(stats.failed),
        "train_steps": sum(r.steps_done for r in runs),
        "samples": stats.ok.get("sample", 0),
        "failed_operations": failed_ops,
        "lost_operations": len(lost),
        "run_errors": run_errors,
        "lost": lost,
        "stuck_threads": stuck,
        "errors": stats.errors[:20],
    }
    return report


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def results_for(report: dict) -> list[dict]:
    cp = report["latency"]["control plane"]
    bad = report["failed_operations"] + report["lost_operations"] + len(report["run_errors"]) + len(report["stuck_threads"])
    total = sum(report["ok"].values()) + report["failed_operations"]
    return [
        {"case": "control-plane p50 latency under load", "value": cp["p50_ms"], "unit": "ms",
         "ratio": round(cp["p50_ms"] / CONTROL_P50_BUDGET_MS, 2) if cp["p50_ms"] is not None else None,
         "target": 1.0, "ok": cp["p50_ms"] is not None and cp["p50_ms"] <= CONTROL_P50_BUDGET_MS},
        {"case": "control-plane p99 latency under load", "value": cp["p99_ms"], "unit": "ms",
         "ratio": round(cp["p99_ms"] / CONTROL_P99_BUDGET_MS, 2) if cp["p99_ms"] is not None else None,
         "target": 1.0, "ok": cp["p99_ms"] is not None and cp["p99_ms"] <= CONTROL_P99_BUDGET_MS},
        {"case": "failed or lost operations", "value": bad, "unit": f"of {total}",
         "ratio": round(bad / max(total, 1), 4), "target": 0.0, "ok": bad == 0},
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="load on the local server (loopback only, bounded)")
    p.add_argument("--url", help="a running local server (default: start one in a temp dir)")
    p.add_argument("--token", help="its token (default: read from LOOPS_STATE_DIR)")
    p.add_argument("--seconds", type=float, default=float(os.environ.get("LOOPS_LOAD_SECONDS", DEFAULT_SECONDS)))
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--samplers", type=int, default=32, help="concurrent sampling requests")
    p.add_argument("--pollers", type=int, default=2)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_SECONDS:.0f} s instead of {DEFAULT_SECONDS:.0f} s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, QUICK_SECONDS)
    if args.url and not args.url.startswith(("http://127.0.0.1:", "http://localhost:")):
        p.error("--url must be a loopback URL (http://127.0.0.1:PORT)")
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    own = None
    url, token = args.url, args.token
    if url is None:
        own = _OwnServer().start()
        url, token = own.url, own.token
    elif token is None:
        from baseten_loops_cli.local import daemon

        token = daemon.read_token() or ""
    try:
        report = run_load(url, token, seconds=args.seconds, n_runs=args.runs, n_samplers=args.samplers,
                          n_pollers=args.pollers, save_every=args.save_every, seed=args.seed, log=log)
    finally:
        if own is not None:
            own.stop()
    results = results_for(report)
    if args.json:
        print(json.dumps({"target": 1.0, "results": results, "report": report}, indent=2))
    else:
        print(f"{'kind':<20} {'count':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
        for kind, v in report["latency"].items():
            print(f"{kind:<20} {v['count']:>7} {_f(v['p50_ms']):>9} {_f(v['p99_ms']):>9} {_f(v['max_ms']):>9}")
        print(f"train steps {report['train_steps']}, samples {report['samples']}, "
              f"failed {report['failed_operations']}, lost {report['lost_operations']}, "
              f"run errors {len(report['run_errors'])} in {report['seconds']} s")
        for line in report["run_errors"] + report["lost"] + report["errors"][:5]:
            print("  " + line)
        for r in results:
            print(f"{r['case']:<40} {r['value']!s:>8} {r['unit']:<8} ratio {r['ratio']} target {r['target']} "
                  f"{'ok' if r['ok'] else 'MISSED'}")
    return 1 if args.check and not all(r["ok"] for r in results) else 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    sys.exit(main())
