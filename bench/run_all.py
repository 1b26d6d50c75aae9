#!/usr/bin/env python
"""Run every bench script and print one table of ratios against their targets.

Each ``bench/<name>.py`` (except this file and ``_*.py``) is run as a subprocess, with
``--json`` when its ``--help`` lists it; it then prints one JSON object on stdout::

    {"target": 1.3,                      # default target for its results (optional)
     "results": [{"case": "loops --help", "ratio": 1.12, "target": 1.3, "ok": true, ...}]}

A result's ``ok`` wins when present; otherwise ``ok = ratio <= target``. ``value``/``unit``
(if given) are shown next to the ratio. A bench without ``--json`` is read from the lines
``NAME: ratio R (target OP T)`` that ``bench/_common.print_ratio`` prints (OP one of <=, <, >=,
>; a trailing % is read as a fraction). A script that exits non-zero, times out or prints
neither becomes one FAILED row, so a broken bench cannot hide.

    python bench/run_all.py                 # every bench, full length
    python bench/run_all.py --quick         # pass --quick to the benches that accept it
    python bench/run_all.py --only load --check --json

``--check`` exits 1 when any row is not ok. Flags a bench accepts are read from its ``--help``
(``--quick`` and ``--check`` are forwarded only to scripts that list them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DEFAULT_TIMEOUT_S = 1200
# Benches that need longer than --timeout on the 2-core machine (seconds; --timeout raises these
# too when it is larger). long_context: SFT at 1k-8k tokens, TRL at 2k and 8k in every
# configuration that fits in memory, RL with 256-token replies, an 8k-token deployment prompt.
# vs_trl: TRL's GRPOTrainer at 256-token replies takes ~85 s a step, in 4 configurations.
BENCH_TIMEOUTS_S = {"long_context": 5400, "long_context --quick": 1800, "vs_trl": 3600}


def discover(only: list[str] | None = None) -> list[Path]:
    scripts = sorted(
        p for p in BENCH_DIR.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_")
    )
    if only:
        scripts = [p for p in scripts if p.stem in only]
    return scripts


_HELP_CACHE: dict[Path, str] = {}


def _accepts(script: Path, flag: str, env: dict) -> bool:
    if script not in _HELP_CACHE:
        try:
            proc = subprocess.run(
                [sys.executable, str(script), "--help"],
                capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, check=False,
            )
            _HELP_CACHE[script] = proc.stdout
        except (OSError, subprocess.TimeoutExpired):
            _HELP_CACHE[script] = ""
    return re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", _HELP_CACHE[script]) is not None


_RATIO_LINE = re.compile(
    r"^(?P<case>[^\n]+?): ratio (?P<ratio>-?[\d.]+(?:e-?\d+)?) \(target (?P<op><=|>=|<|>|=)?\s*(?P<target>-?[\d.]+)(?P<pct>%)?[^)\n]*\)(?:; (?P<detail>[^\n]*))?",
    re.MULTILINE,
)


def parse_ratio_lines(text: str) -> dict | None:
    """``NAME: ratio R (target >= T); detail`` lines (bench/_common.print_ratio) as a JSON doc."""
    results = []
    for m in _RATIO_LINE.finditer(text):
        ratio = float(m["ratio"])
        target = float(m["target"]) / (100.0 if m["pct"] else 1.0)
        op = m["op"] or "<="
        ok = {"<=": ratio <= target, "<": ratio < target, ">=": ratio >= target,
              ">": ratio > target, "=": ratio == target}[op]
        results.append({"case": m["case"].strip(), "ratio": ratio, "target": target, "op": op, "ok": ok,
                        "detail": m["detail"]})
    return {"results": results} if results else None


def run_script(script: Path, *, quick: bool, timeout_s: float, env: dict) -> dict:
    """Run one bench; returns {name, rows:[...], seconds, error?}."""
    as_json = _accepts(script, "--json", env)
    cmd = [sys.executable, str(script)] + (["--json"] if as_json else [])
    if quick and _accepts(script, "--quick", env):
        cmd.append("--quick")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return {"name": script.stem, "rows": [], "seconds": time.monotonic() - t0,
                "error": f"timed out after {timeout_s:.0f} s"}
    seconds = time.monotonic() - t0
    doc = _last_json_object(proc.stdout) if as_json else parse_ratio_lines(proc.stdout)
    if doc is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"name": script.stem, "rows": [], "seconds": seconds,
                "error": f"exit {proc.returncode}, no result ({tail[0][:200]})"}
    rows = normalise(doc)
    out = {"name": script.stem, "rows": rows, "seconds": seconds}
    if proc.returncode not in (0, 1):  # 1 = a --check failure, still a valid table
        out["error"] = f"exit {proc.returncode}"
    return out


def _last_json_object(stdout: str) -> dict | None:
    text = stdout.strip()
    if not text:
        return None
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, dict) else None
    except ValueError:
        pass
    # Tolerate log lines before the JSON: take the last line that starts a JSON object.
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith("{"):
            try:
                doc = json.loads("\n".join(lines[i:]))
            except ValueError:
                continue
            return doc if isinstance(doc, dict) else None
    return None


def normalise(doc: dict) -> list[dict]:
    default_target = doc.get("target")
    rows = []
    for r in doc.get("results") or []:
        if not isinstance(r, dict):
            continue
        ratio = r.get("ratio")
        target = r.get("target", default_target)
        ok = r.get("ok")
        if ok is None and isinstance(ratio, (int, float)) and isinstance(target, (int, float)):
            ok = ratio <= target
        value, unit = r.get("value"), r.get("unit", "")
        if value is None:  # e.g. startup.py's {"loops_ms": 312.0}: show the first measurement
            for key, v in r.items():
                if key not in ("ratio", "target", "ok", "case") and isinstance(v, (int, float)) \
                        and not isinstance(v, bool):
                    value, unit = v, key.rsplit("_", 1)[-1] if "_" in key else ""
                    break
        rows.append({
            "case": str(r.get("case", "?")),
            "value": value,
            "unit": unit,
            "ratio": ratio,
            "target": target,
            "op": r.get("op") or _infer_op(ratio, target, r.get("ok")),
            "ok": bool(ok),
            "detail": r.get("detail"),
        })
    return rows


def _infer_op(ratio, target, ok) -> str:
    """The direction of a target, when a bench gave ``ok`` but not ``op``."""
    if ok is None:
        return "<="
    if not isinstance(ratio, (int, float)) or not isinstance(target, (int, float)):
        return ""
    below, above = ratio <= target, ratio >= target
    if below != above:
        return "<=" if bool(ok) == below else ">="
    return ""


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def table_rows(results: list[dict]) -> list[tuple[str, ...]]:
    """(bench, case, measured, ratio, target, status) per row; a failed bench is a FAILED row."""
    rows = []
    for res in results:
        if res.get("error") and not res["rows"]:
            rows.append((res["name"], "(bench failed)", res["error"][:100], "-", "-", "FAILED"))
        for r in res["rows"]:
            value = f"{_fmt(r['value'])} {r['unit']}".strip() if r["value"] is not None else "-"
            target = f"{r['op']} {_fmt(r['target'])}".strip() if r["target"] is not None else "-"
            status = "-" if r["target"] is None else "ok" if r["ok"] else "MISSED"  # - : reported only
            rows.append((res["name"], r["case"], value, _fmt(r["ratio"]), target, status))
        if res.get("error") and res["rows"]:
            rows.append((res["name"], "(bench exit)", res["error"][:100], "-", "-", "FAILED"))
    return rows


HEADER = ("bench", "case", "measured", "ratio", "target", "status")


def print_table(results: list[dict]) -> None:
    rows = table_rows(results)
    header = HEADER
    widths = [max(len(h), *(len(str(row[i])) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    total = sum(res["seconds"] for res in results)
    print(f"({len(results)} benches in {total:.0f} s; each row's status uses its bench's own target)")
    print(f"(bench servers' dtype: {bench_dtype()}, {compute_dtype()} compute; this CPU's bf16 "
          f"instructions: {cpu_bf16() or 'none'})")


# The table's place: docs/benchmarks.md, between these markers (the README links there).
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
DOCS_START = "<!-- bench/run_all.py --docs: start -->"
DOCS_END = "<!-- bench/run_all.py --docs: end -->"


def markdown(results: list[dict], started: str) -> str:
    """The run as docs/benchmarks.md shows it: when, where, with which dtype, then one row per result."""
    total = sum(res["seconds"] for res in results)
    statuses = [row[-1] for row in table_rows(results) if row[-1] != "-"]
    lines = [
        f"Measured {started} by `python bench/run_all.py --docs` ({total / 60:.0f} min, "
        f"{statuses.count('ok')} of {len(statuses)} targets met) on {machine()}; bench servers' dtype "
        f"`{bench_dtype()}`, {compute_dtype()} compute (this CPU's bf16 instructions: "
        f"{cpu_bf16() or 'none'}).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for row in table_rows(results):
        cells = [str(c).replace("|", "\\|") for c in row]
        if cells[-1] not in ("ok", "-"):
            cells[-1] = f"**{cells[-1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_docs(text: str, page: Path = DOCS_PAGE) -> None:
    """Replace what lies between the page's two markers with ``text``."""
    body = page.read_text()
    start, end = body.find(DOCS_START), body.find(DOCS_END)
    if start < 0 or end < start:
        raise SystemExit(f"{page} has no {DOCS_START} ... {DOCS_END} section to replace")
    page.write_text(body[: start + len(DOCS_START)] + "\n" + text + "\n" + body[end:])


def machine() -> str:
    cores = os.cpu_count() or 0
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        model = ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cores} cores{f' ({model})' if model else ''}, load average {load:.1f} at the end"


def bench_dtype() -> str:
    """The dtype bench servers are started with (train_throughput.SERVER_OPTIONS reads the
    same; auto is bfloat16 where this CPU has bf16 instructions, see cpu_bf16)."""
    return os.environ.get("LOOPS_BENCH_DTYPE", "auto")


def compute_dtype() -> str:
    """What the bench dtype resolves to on this CPU: the engine's own rule (precision.resolve
    imports no torch for a CPU)."""
    from baseten_loops_cli.local.engine import precision

    return precision.resolve(bench_dtype(), "cpu").dtype


def cpu_bf16() -> str:
    from baseten_loops_cli.local.engine import precision

    return ", ".join(precision.cpu_bf16_flags())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run every bench script; one table of ratios vs targets")
    parser.add_argument("--quick", action="store_true", help="pass --quick to benches that accept it")
    parser.add_argument("--only", action="append", help="run only this bench (repeatable; name without .py)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per bench")
    parser.add_argument("--check", action="store_true", help="exit 1 when any row is not ok")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--list", action="store_true", help="list the benches and exit")
    parser.add_argument("--docs", action="store_true",
                        help="also write the table into docs/benchmarks.md, between its bench markers")
    parser.add_argument("--save", type=Path, help="also write every bench's rows and details as JSON here")
    args = parser.parse_args(argv)

    scripts = discover(args.only)
    if args.list:
        for s in scripts:
            print(s.stem)
        return 0
    if not scripts:
        print("no bench scripts found", file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for script in scripts:
        print(f"running {script.name} ...", file=sys.stderr, flush=True)
        own = BENCH_TIMEOUTS_S.get(script.stem + (" --quick" if args.quick else ""), 0)
        results.append(run_script(script, quick=args.quick, timeout_s=max(args.timeout, own), env=env))
    all_ok = all(not r.get("error") and r["rows"] and all(row["ok"] for row in r["rows"]) for r in results)
    if args.json:
        # Target ratios, one flat list: what the table shows.
        targets = [
            {"bench": r["name"], "case": row["case"], "ratio": row["ratio"], "target": row["target"],
             "op": row["op"], "value": row["value"], "unit": row["unit"], "ok": row["ok"]}
            for r in results for row in r["rows"]
        ]
        print(json.dumps({
            "results": [
                {"case": f"{t['bench']}: {t['case']}", "ratio": t["ratio"], "target": t["target"],
                 "op": t["op"], "value": t["value"], "unit": t["unit"], "ok": t["ok"]}
                for t in targets
            ],
            "benches": results,
            "dtype": bench_dtype(),
            "ok": all_ok,
        }, indent=2))
    else:
        print_table(results)
    if args.save:
        args.save.write_text(json.dumps({"started": started, "dtype": bench_dtype(), "machine": machine(),
                                         "benches": results}, indent=2) + "\n")
    if args.docs:
        write_docs(markdown(results, started))
    return 1 if args.check and not all_ok else 0


if __name__ == "__main__":
    sys.exit(main())
