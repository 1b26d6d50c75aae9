"""Measured training speed on this machine, for the local backend's time estimates.

A finished local run records how long it took per planned token (the plan's own token counts,
so eval, checkpoints and sampling are all in the rate) under the cache dir, per (kind, base
model); the next plan of that model uses it. Remote backends are not calibrated: provisioning
dominates there and the rates belong to the service.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

STARTUP_S = 3.0  # process start, run creation and the final checkpoint, outside the per-token rate


@dataclass
class Measured:
    s_per_token: float
    startup_s: float = STARTUP_S


def _file() -> Path:
    from baseten_loops_cli.settings.paths import cache_dir

    return cache_dir() / "train-calibration.json"


def _read() -> dict:
    try:
        return json.loads(_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def lookup(kind: str, base_model: str) -> Measured | None:
    entry = _read().get(f"{kind}:{base_model}")
    if not isinstance(entry, dict) or not isinstance(entry.get("s_per_token"), (int, float)):
        return None
    return Measured(float(entry["s_per_token"]), float(entry.get("startup_s", STARTUP_S)))


def record(kind: str, base_model: str, *, seconds: float, tokens: int) -> None:
    """Remember a completed run's speed: ``seconds`` of wall time for ``tokens`` planned tokens."""
    if tokens <= 0 or seconds <= STARTUP_S:
        return
    data = _read()
    data[f"{kind}:{base_model}"] = {
        "s_per_token": (seconds - STARTUP_S) / tokens, "startup_s": STARTUP_S, "measured_at": time.time(),
    }
    path = _file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # an estimate is not worth failing a finished run for
