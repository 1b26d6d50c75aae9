"""Load: 4 concurrent training runs + 32 concurrent sampling requests on one local server for
LOOPS_LOAD_SECONDS (default 120; .ci/run may reduce it), loopback only and bounded: no failed
or lost operation; p50/p99 of control-plane calls reported (bench/load.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOAD_SECONDS = float(os.environ.get("LOOPS_LOAD_SECONDS", "120"))


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_load_no_failed_or_lost_operations(server_factory, capsys):
    pytest.importorskip("torch")
    load = _bench_module("load")
    server = server_factory()
    assert server.url.startswith("http://127.0.0.1:")
    report = load.run_load(server.url, server.token, seconds=LOAD_SECONDS, n_runs=4, n_samplers=32,
                           log=lambda s: None)
    cp = report["latency"]["control plane"]
    with capsys.disabled():
        print(f"\nload {report['seconds']}s: control plane p50 {cp['p50_ms']} ms, p99 {cp['p99_ms']} ms "
              f"({cp['count']} calls); train steps {report['train_steps']}, samples {report['samples']}, "
              f"failed {report['failed_operations']}, lost {report['lost_operations']}")
    assert report["run_errors"] == [], report["run_errors"]
    assert report["stuck_threads"] == [], report["stuck_threads"]
    assert report["failed_operations"] == 0, report["errors"]
    assert report["lost_operations"] == 0, report["lost"]
    assert report["train_steps"] >= 4 and report["samples"] >= 32
    assert cp["count"] > 0 and cp["p50_ms"] is not None and cp["p99_ms"] is not None


def test_run_all_lists_every_bench_and_tabulates(tmp_path):
    """bench/run_all.py finds every bench script and turns their JSON into one table."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "run_all.py"), "--list"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    expected = {p.stem for p in (ROOT / "bench").glob("*.py") if p.name != "run_all.py" and not p.name.startswith("_")}
    assert set(out) == expected and "load" in out
    run_all = _bench_module("run_all")
    rows = run_all.normalise({"target": 1.3, "results": [
        {"case": "a", "ratio": 1.1, "loops_ms": 300.0},
        {"case": "b", "ratio": 2.0},
        {"case": "c", "ratio": 0.0, "target": 0.0, "ok": True, "value": 0, "unit": "ops"},
    ]})
    assert [r["ok"] for r in rows] == [True, False, True]
    assert rows[0]["value"] == 300.0 and rows[0]["unit"] == "ms"
    assert json.loads(json.dumps(rows))  # JSON-clean
    # Benches without --json print bench/_common.print_ratio lines; their target direction counts.
    doc = run_all.parse_ratio_lines("a: ratio 0.917 (target < 1.0 where both overlap); x\n"
                                    "b: ratio 0.114 (target <= 10%); y\nc: ratio 0.95 (target >= 0.9); z")
    assert [(r["case"], r["op"], r["ok"]) for r in doc["results"]] == [("a", "<", True), ("b", "<=", False), ("c", ">=", True)]
    assert [r["detail"] for r in doc["results"]] == ["x", "y", "z"]
    # --docs: the table replaces what lies between docs/benchmarks.md's markers, and nothing else.
    results = [{"name": "one", "rows": run_all.normalise(doc), "seconds": 60.0},
               {"name": "two", "rows": [], "seconds": 1.0, "error": "timed out after 1200 s"}]
    table = run_all.markdown(results, "2026-12-05 07:00 UTC")
    assert "| one | b | - | 0.114 | <= 0.1 | **MISSED** |" in table and "| two | (bench failed) |" in table
    assert "2 of 4 targets met" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{run_all.DOCS_START}\nold table\n{run_all.DOCS_END}\nafter\n")
    run_all.write_docs(table, readme)
    body = readme.read_text()
    assert "old table" not in body and table in body and body.startswith("# x\nbefore\n") and body.endswith("after\n")
