"""Measured training speed on this machine, for the local backend's time estimates.

A finished local run records, under the cache dir and per (kind, base model), its step time per
planned token (the plan's own token counts, so sampling and in-run evals are in the rate) and
its fixed cost (the wall time outside steps: run creation, final eval and checkpoint); the next
plan of that model uses both: its own kind's measurement when there is one, else another kind's
of the same model (the step cost per token scaled by this plan's tokens), and says which. Remote backends are not calibrated: provisioning
dominates there and the rates belong to the service.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

STARTUP_S = 3.0  # fixed cost of a run when an old calibration file does not say
# Other load per core above which a plan's time becomes a range: under it a run gets the CPU it
# was calibrated with; over it, a CPU-bound run shares the cores with that many runnable processes.
BUSY_PER_CORE = 0.5


@dataclass
class Measured:
    s_per_token: float
    startup_s: float = STARTUP_S
    # The kind whose run was measured: the plan's own kind, or (none of that kind measured yet)
    # another kind's run of the same model, its step cost per token applied to this plan's tokens.
    kind: str = ""
    scaled: bool = False

    def note(self, base_model: str) -> str:
        if self.scaled:
            return (f"time estimate calibrated from this model's last {self.kind} run on this machine, scaled by "
                    "tokens (this kind has no measured run yet)")
        return f"time estimate calibrated by the last {self.kind} run of {base_model} on this machine"


def machine_load() -> tuple[float, int]:
    """(load average, CPU cores) of this machine: the higher of the 1- and 5-minute load
    averages (/proc/loadavg), so a dip of a minute does not hide a busy machine."""
    try:
        load = max(os.getloadavg()[:2])
    except (OSError, AttributeError):  # no load average on this platform: assume idle
        load = 0.0
    return load, os.cpu_count() or 1


def slowdown(load: float, cores: int) -> float | None:
    """How many times longer a CPU-bound run may take on ``cores`` cores with ``load`` runnable
    processes besides it (its threads get ``cores / (cores + load)`` of the CPU), or None when
    the machine is not busy (the calibrated time holds)."""
    if load / cores < BUSY_PER_CORE:
        return None
    return (cores + load) / cores


def _file() -> Path:
    from baseten_loops_cli.settings.paths import cache_dir

    return cache_dir() / "train-calibration.json"


def _read() -> dict:
    try:
        return json.loads(_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _usable(entry: object) -> TypeGuard[dict]:
    return isinstance(entry, dict) and isinstance(entry.get("s_per_token"), (int, float))


def lookup(kind: str, base_model: str) -> Measured | None:
    """This kind's measurement of the model, else the newest measurement of any other kind of
    the same model (per planned token, so it scales with this plan's tokens), else None."""
    data = _read()
    entry = data.get(f"{kind}:{base_model}")
    if _usable(entry):
        return Measured(float(entry["s_per_token"]), float(entry.get("startup_s", STARTUP_S)), kind)
    others = [(key.split(":", 1)[0], value) for key, value in data.items()
              if key.split(":", 1)[-1] == base_model and key != f"{kind}:{base_model}" and _usable(value)]
    if not others:
        return None
    other_kind, entry = max(others, key=lambda item: float(item[1].get("measured_at") or 0))
    return Measured(float(entry["s_per_token"]), float(entry.get("startup_s", STARTUP_S)), other_kind, scaled=True)


def record(kind: str, base_model: str, *, seconds: float, step_seconds: float, tokens: int) -> None:
    """Remember a completed run's speed: ``step_seconds`` of its ``seconds`` of wall time were
    spent in steps, for ``tokens`` planned tokens; the rest (run creation, final eval and
    checkpoint) is the fixed cost of a run."""
    if tokens <= 0 or step_seconds <= 0:
        return
    data = _read()
    data[f"{kind}:{base_model}"] = {
        "s_per_token": step_seconds / tokens,
        "startup_s": max(0.0, seconds - step_seconds),
        "measured_at": time.time(),
    }
    path = _file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # an estimate is not worth failing a finished run for
