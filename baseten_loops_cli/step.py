"""``Step``: what an RL environment's ``step`` returns (``from baseten_loops_cli import Step``).

Standard library only, so an environment file imports it for free and ``loops --help`` never
pays for it. A plain dict with the same keys is accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    """One turn's outcome: the turn's ``reward``, whether the episode is ``done``, the
    ``messages`` (user or tool turns) appended before the model's next reply, and free-form
    ``info`` kept in samples.jsonl."""

    reward: float = 0.0
    done: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
