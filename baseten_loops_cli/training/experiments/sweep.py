"""Sweeps: one config, many points (the product of ``--grid`` values, or N random draws of it),
each trained in its own run directory under one sweep folder.

    SWEEP_DIR/sweep.json     the index: the config, the grid, and one entry per point (its
                             name, its run directory, its ``--set`` values). Written once.
    SWEEP_DIR/NN-KEY=V-.../  a run directory (training/experiments/rundir.py) per point, plus train.log:
                             what that point's `loops train` process printed

How a point ended is its own state.json (the single truth, as for any run): `loops train resume
SWEEP_DIR` starts the points that never started, resumes those that stopped or failed, and leaves
the completed ones, so every point trains exactly once.

Each point runs as a process of its own, not a thread: the caller says which, through a
:data:`ChildCommand` (the CLI's is `loops train run|resume --run-dir`, so this module knows no
command-line spelling), and Ctrl-C,
the trainer's state and the run directory are per process already (session.StopRequested is a
main-thread signal handler; a crash, OOM or `kill` of one point cannot take the others down; a
point's output is one log file). The sweep process only starts, watches and stops them: it asks
each to stop with SIGINT (what Ctrl-C does to a single run), and on Linux each point gets SIGINT
from the kernel when the sweep process dies (PR_SET_PDEATHSIG), so `kill -9` of a sweep leaves
no training behind: every point saves and stops as after Ctrl-C. A run directory's lock (.lock,
held by the process that trains in it) makes a resume wait for a point still stopping.

The orchestration is here too: :func:`plan_sweep` loads, checks and plans every point (what
`loops train sweep` shows and confirms), :func:`create` writes the index, :func:`run` trains it.
Nothing here prints: progress goes to ``on_event(text)``.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from baseten_loops_cli.services import Connected  # the backend: cli._backend.Backend is one

from baseten_loops_cli.api.polling import Poll
from baseten_loops_cli.errors import ConfigError, InterruptedByUser, LoopsError, UsageError
from baseten_loops_cli.training.experiments.rundir import SWEEP_INDEX, RunDir, atomic_write

DEFAULT_MAX_RUNS = 64
# Other tools' names for config keys (what people type first).
_SPELLINGS = {"lr": "learning_rate", "rank": "lora_rank", "steps": "max_steps", "bs": "batch_size",
              "batch": "batch_size", "wd": "weight_decay", "warmup": "warmup_steps"}
LOG_NAME = "train.log"
_POLL_S = 0.2


@dataclass
class SweepPoint:
    name: str  # the run directory's name inside the sweep folder
    params: dict[str, str]  # config key -> the value as typed (a YAML scalar, as --set takes it)

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.params.items()]


@dataclass
class SweepSpec:
    """What to sweep: the command line's, or the config's ``sweep:`` block where it says nothing."""

    grid: dict[str, list[str]]
    random: int | None = None
    seed: int = 0
    max_runs: int = DEFAULT_MAX_RUNS
    parallel: int | None = None


@dataclass
class Sweep:
    path: Path
    index: dict
    points: list[SweepPoint] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return Path(self.index["config"])

    @property
    def sets(self) -> list[str]:
        return list(self.index.get("sets") or [])

    def rundir(self, point: SweepPoint) -> RunDir:
        return RunDir(self.path / point.name)

    def status(self, point: SweepPoint) -> str:
        """The point's state.json status; ``pending`` before it started."""
        rundir = self.rundir(point)
        return str(rundir.read_state().get("status") or "created") if rundir.exists() else "pending"


@dataclass
class PointOutcome:
    point: SweepPoint
    status: str  # completed, interrupted, failed, pending (never started)
    error: str | None = None


@dataclass
class SweepResult:
    sweep: Sweep
    outcomes: list[PointOutcome]

    @property
    def failed(self) -> list[PointOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]


@dataclass(frozen=True)
class PointJob:
    """What the process of one point is to do: train ``config`` with ``overrides`` (``--set``
    values) into ``run_dir``, or, with ``resume``, continue the run directory that is there."""

    config: Path
    overrides: list[str]
    run_dir: Path
    resume: bool


# The entry point of a point's process: the argv that trains one PointJob and writes its
# state.json (exit 0 completed, 130 interrupted). The command line supplies it.
ChildCommand = Callable[[PointJob], list[str]]


@dataclass
class SweepPlan:
    """A sweep checked and planned, nothing written or provisioned: its folder, the points, each
    point's prepared run (``service.PreparedRun``: config, data, plan), the backend they train
    on and how many train at a time."""

    path: Path
    config: Path
    sets: list[str]
    spec: SweepSpec
    points: list[SweepPoint]
    prepared: list[Any]
    backend: "Connected"
    parallel: int

    def create(self) -> Sweep:
        return create(self.path, self.config, self.sets, self.spec, self.points, parallel=self.parallel)


def plan_sweep(config: Path, sets: list[str], grid: list[str], *, random_n: int | None, seed: int | None,
               max_runs: int | None, parallel: int | None, sweep_dir: Path | None,
               open_backend: Callable[[Any], Any]) -> SweepPlan:
    """Load and check the config and every point of the grid (files too), then plan each point on
    the backend ``open_backend(loaded config)`` returns. Raises the first problem found."""
    from baseten_loops_cli.training import service

    loaded = service.load(config, sets)
    spec = spec_of(loaded, parse_grid(grid), random_n=random_n, seed=seed, max_runs=max_runs, parallel=parallel)
    check(config, sets, spec, loaded)
    pts = points(spec)
    target = sweep_dir or default_sweep_dir(loaded.config.name)
    check_target(target)
    point_configs = [service.load(config, [*sets, *p.overrides]) for p in pts]
    backend = open_backend(loaded)
    prepared = [service.prepare(one, RunDir(target / p.name), backend) for p, one in zip(pts, point_configs)]
    at_once = min(len(pts), spec.parallel or (len(pts) if backend.capabilities.billable else 1))
    return SweepPlan(target, config, sets, spec, pts, prepared, backend, at_once)


# ------------------------------------------------------------------ the points
def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``key=v1,v2`` items -> {key: [v1, v2]} (values as typed; YAML parses them per point)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise UsageError(f"--grid {item!r}: expected key.path=v1,v2", hint="e.g. --grid optimizer.learning_rate=1e-4,3e-4")
        if key in grid:
            raise UsageError(f"--grid {key!r} is given twice", hint="Give all its values in one --grid key=v1,v2.")
        split = [v.strip() for v in values.split(",")]
        if any(not v for v in split):
            raise UsageError(f"--grid {item!r}: an empty value", hint="Separate values with single commas: key=v1,v2.")
        twice = sorted({v for v in split if split.count(v) > 1})
        if twice:
            raise UsageError(f"--grid {key}: {twice[0]!r} is listed twice (two runs would be the same)",
                             hint="List each value once.")
        grid[key] = split
    return grid


def spec_of(loaded: Any, grid: dict[str, list[str]], *, random_n: int | None, seed: int | None,
            max_runs: int | None, parallel: int | None) -> SweepSpec:
    """The command line's sweep, its gaps filled from the config's ``sweep:`` block."""
    block = loaded.config.sweep
    if not grid and block is not None:
        grid = {key: [_as_text(v) for v in values] for key, values in block.grid.items()}
    if not grid:
        raise UsageError("nothing to sweep: no --grid and no sweep: block in the config",
                         hint="Add --grid key=v1,v2 (e.g. --grid optimizer.learning_rate=1e-4,3e-4).")
    pick = lambda cli, key, default: cli if cli is not None else (getattr(block, key) if block is not None and getattr(block, key) is not None else default)  # noqa: E731
    return SweepSpec(grid=grid, random=pick(random_n, "random", None), seed=pick(seed, "seed", 0),
                     max_runs=pick(max_runs, "max_runs", DEFAULT_MAX_RUNS), parallel=pick(parallel, "parallel", None))


def _as_text(value: Any) -> str:
    """A YAML value of the sweep: block as --set would type it."""
    import yaml

    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def config_keys(model: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config model (sections included), e.g. ``optimizer.learning_rate``."""
    from pydantic import BaseModel

    keys = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        candidates = getattr(info.annotation, "__args__", None) or (info.annotation,)
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if sub is not None:
            keys += config_keys(sub, dotted + ".")
    return keys


def check(config: Path, sets: list[str], spec: SweepSpec, loaded: Any) -> None:
    """Every grid key is a config key, every value passes its key's type, and the sweep fits
    ``max_runs``: one line each, before anything is provisioned."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.config import ConfigProblems, load_config

    keys = config_keys(kinds.of(loaded.config).config_model)
    for key in spec.grid:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
            leaf_name = key.rsplit(".", 1)[-1]
            leaf_name = _SPELLINGS.get(leaf_name, leaf_name)
            leaf = difflib.get_close_matches(leaf_name, [k.rsplit(".", 1)[-1] for k in keys], n=1, cutoff=0.6)
            if not close and leaf:
                close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf[0]][:1]
            raise ConfigError(f"--grid {key!r}: not a config key" + (f"; did you mean {close[0]!r}?" if close else ""),
                             hint=f"Use --grid {close[0]}=..." if close else "Run `loops train init` to see the keys.")
        if key == "sweep" or key.startswith("sweep."):
            raise UsageError(f"--grid {key!r}: a sweep cannot sweep its own settings", hint="Pick a training key.")
    for key, values in spec.grid.items():
        for value in values:
            try:
                load_config(config, [*sets, f"{key}={value}"])
            except ConfigProblems as exc:
                problem = exc.problems[0]
                raise ConfigError(f"--grid {key}={value}: {problem.message}",
                                 hint=f"Give {key} values of its type." if problem.override else problem.fix) from None
    size = 1
    for values in spec.grid.values():
        size *= len(values)
    if spec.random is not None and spec.random < 1:
        raise UsageError(f"--random must be at least 1, not {spec.random}")
    count = min(size, spec.random) if spec.random is not None else size
    if count > spec.max_runs:
        shape = " x ".join(str(len(v)) for v in spec.grid.values())
        raise UsageError(f"the sweep has {count} runs ({shape}), more than --max-runs {spec.max_runs}",
                         hint=f"Pass --max-runs {count}, fewer values, or --random N to draw N of them.")
    if spec.parallel is not None and spec.parallel < 1:
        raise UsageError(f"--parallel must be at least 1, not {spec.parallel}")


def points(spec: SweepSpec) -> list[SweepPoint]:
    """The grid's product in order (the last key varies fastest), or ``spec.random`` distinct
    points of it drawn with ``spec.seed``; each named NN-key=value-... (unique by its number)."""
    keys = list(spec.grid)
    combos = list(itertools.product(*(spec.grid[k] for k in keys)))
    if spec.random is not None and spec.random < len(combos):
        chosen = sorted(random.Random(spec.seed).sample(range(len(combos)), spec.random))
        combos = [combos[i] for i in chosen]
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    labels = leaves if len(set(leaves)) == len(leaves) else keys
    width = max(2, len(str(len(combos) - 1)))
    out = []
    for i, combo in enumerate(combos):
        slug = "-".join(f"{label}={value}" for label, value in zip(labels, combo))
        slug = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", slug)[:80]
        out.append(SweepPoint(f"{i:0{width}d}-{slug}", dict(zip(keys, combo))))
    return out


def default_sweep_dir(name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "sweep"
    return Path("runs") / f"sweep-{slug}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_target(path: Path) -> None:
    """A sweep folder must be new (or an empty folder): two sweeps never share run directories."""
    if (path / SWEEP_INDEX).exists():
        raise UsageError(f"{path} already holds a sweep",
                         hint=f"Finish it with `loops train resume {path}`, or pass another --sweep-dir.")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UsageError(f"{path} is not an empty folder", hint="Pass a new --sweep-dir.")


def create(path: Path, config: Path, sets: list[str], spec: SweepSpec, pts: list[SweepPoint], *, parallel: int) -> Sweep:
    """Write the sweep's index (the points and their run directories): nothing is trained yet."""
    check_target(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoopsError(f"cannot create the sweep folder {path}: {(exc.strerror or '').lower()}",
                         hint="Pass another --sweep-dir.") from None
    index = {
        "config": str(Path(config).resolve()),
        "sets": sets,
        "grid": spec.grid,
        "random": spec.random,
        "seed": spec.seed,
        "parallel": parallel,  # what `loops train resume SWEEP_DIR` runs at a time
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": [{"name": p.name, "dir": p.name, "params": p.params} for p in pts],
    }
    atomic_write(path / SWEEP_INDEX, json.dumps(index, indent=2) + "\n")
    return Sweep(path, index, pts)


def open_sweep(path: Path) -> Sweep:
    try:
        index = json.loads((path / SWEEP_INDEX).read_text(encoding="utf-8"))
        pts = [SweepPoint(str(r["name"]), {str(k): str(v) for k, v in r["params"].items()}) for r in index["runs"]]
        index["config"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path / SWEEP_INDEX}: not a sweep index ({type(exc).__name__})",
                          hint="`loops train sweep` writes this file: undo the edit to it.") from None
    return Sweep(path, index, pts)


def loaded_points(sweep: Sweep) -> list[Any]:
    """Each point's config, loaded and checked (files too): what the summed plan is made of."""
    from baseten_loops_cli.training.config import load_config
    from baseten_loops_cli.training.experiments.trackers import check_installed

    loaded = [load_config(sweep.config, [*sweep.sets, *p.overrides], check_files=True) for p in sweep.points]
    for one in loaded[:1]:
        check_installed(one.config.logging.trackers)
    return loaded


# ------------------------------------------------------------------ running
def _stop_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: SIGINT (a clean stop, as Ctrl-C) when the sweep process dies, even by SIGKILL."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT)
    except (OSError, AttributeError):
        pass


def _job(sweep: Sweep, point: SweepPoint) -> PointJob:
    rundir = sweep.rundir(point)
    return PointJob(sweep.config, [*sweep.sets, *point.overrides], rundir.path, resume=rundir.exists())


def run(sweep: Sweep, *, parallel: int, command: ChildCommand, on_event: Callable[[str], None],
        env: dict[str, str] | None = None) -> SweepResult:
    """Train every point that is not completed, ``parallel`` at a time, one process each.

    The first SIGINT (Ctrl-C) asks every running point to stop after its step in flight and
    starts no more; a second one is passed on too (they stop at once, as a single run does).
    Raises InterruptedByUser (exit 130) after an interrupt, once every point has stopped."""
    todo = [p for p in sweep.points if sweep.status(p) != "completed"]
    if len(todo) < len(sweep.points):
        on_event(f"{len(sweep.points) - len(todo)} of {len(sweep.points)} runs already completed.")
    running: dict[str, tuple[SweepPoint, subprocess.Popen, Any]] = {}
    outcomes: dict[str, PointOutcome] = {}
    interrupts = 0
    waiting_said: set[str] = set()

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupts
        interrupts += 1
        for _, proc, _ in running.values():
            try:
                proc.send_signal(signal.SIGINT)
            except OSError:
                pass

    main = sys.platform != "win32" and _is_main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main else None
    child_env = {**os.environ, **(env or {}), "NO_COLOR": "1"}
    child_env.pop("FORCE_COLOR", None)
    total = len(sweep.points)
    try:
        for _ in Poll(interval=_POLL_S):
            if not ((todo and not interrupts) or running):
                break
            # Start what fits; a point whose directory a stopping process still holds waits.
            for point in list(todo):
                if interrupts or len(running) >= parallel:
                    break
                rundir = sweep.rundir(point)
                holder = rundir.lock_holder() if rundir.path.exists() else None
                if holder is not None:
                    if point.name not in waiting_said:
                        on_event(f"{point.name}: waiting for process {holder} to let go of it")
                        waiting_said.add(point.name)
                    continue
                todo.remove(point)
                rundir.path.mkdir(parents=True, exist_ok=True)
                log = open(rundir.path / LOG_NAME, "ab")
                what = "resuming" if rundir.exists() else "starting"
                proc = subprocess.Popen(command(_job(sweep, point)), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                                        preexec_fn=_stop_with_parent if sys.platform.startswith("linux") else None)
                running[point.name] = (point, proc, log)
                index = sweep.points.index(point) + 1
                on_event(f"[{index}/{total}] {what} {point.name} ({', '.join(point.overrides)})")
            for name, (point, proc, log) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                log.close()
                del running[name]
                outcome = _outcome(sweep, point, rc)
                outcomes[name] = outcome
                on_event(f"{name}: {outcome.status}" + (f" ({outcome.error})" if outcome.error else ""))
    finally:
        for _, proc, log in running.values():  # only on an exception of our own: stop them cleanly
            try:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
            log.close()
        if main:
            signal.signal(signal.SIGINT, previous)
    result = SweepResult(sweep, [outcomes.get(p.name) or PointOutcome(p, sweep.status(p)) for p in sweep.points])
    if interrupts:
        left = [o.point.name for o in result.outcomes if o.status != "completed"]
        raise SweepInterrupted(f"sweep stopped: {len(left)} of {total} runs not completed",
                               result, hint=f"Finish it with `loops train resume {sweep.path}`.")
    return result


class SweepInterrupted(InterruptedByUser):
    def __init__(self, message: str, result: SweepResult, hint: str):
        super().__init__(message, hint=hint)
        self.result = result


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _outcome(sweep: Sweep, point: SweepPoint, rc: int) -> PointOutcome:
    state = sweep.rundir(point).read_state() if sweep.rundir(point).exists() else {}
    status = str(state.get("status") or "pending")
    if rc == 0 and status == "completed":
        return PointOutcome(point, "completed")
    if rc == 130 or status == "interrupted":
        return PointOutcome(point, "interrupted")
    error = state.get("error") or _last_error(sweep.rundir(point).path / LOG_NAME) or f"exit code {rc}"
    return PointOutcome(point, "failed", str(error))


def _last_error(log: Path) -> str | None:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    errors = [line.removeprefix("Error: ") for line in lines if line.startswith("Error: ")]
    return errors[-1] if errors else None
