"""Checkpoint URIs: ``bt://loops:<run_id>/weights/<name>`` and ``.../sampler_weights/<name>``.

``weights/`` is a trainer-state checkpoint (load it with ``load_state`` or a run's ``path``);
``sampler_weights/`` is a sampler (LoRA adapter) checkpoint (``X-Checkpoint-Path``,
``model_path``, ``/checkpoints/validate``, deploy). The ``abt://`` spelling some tools print is
accepted and normalised to ``bt://``. Pure stdlib: cheap to import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from baseten_loops_cli.errors import UsageError

Target = Literal["trainer", "sampler"]

_DIR_FOR_TARGET: dict[str, str] = {"trainer": "weights", "sampler": "sampler_weights"}
_TARGET_FOR_DIR: dict[str, Target] = {"weights": "trainer", "sampler_weights": "sampler"}

EXPECTED_FORM = "bt://loops:<run_id>/weights/<name> or bt://loops:<run_id>/sampler_weights/<name>"

# run ids are opaque strings (hashids in production; tests use e.g. "run_abc123"); names are
# whatever the user saved under, minus "/" (a trailing slash from S3 weight sync is tolerated).
_URI_RE = re.compile(
    r"^a?bt://loops:(?P<run>[A-Za-z0-9][A-Za-z0-9_.\-]*)/(?P<dir>weights|sampler_weights)/(?P<name>[^/\s]+)/?$"
)


@dataclass(frozen=True)
class CheckpointUri:
    run_id: str
    target: Target
    name: str

    @classmethod
    def parse(cls, value: str) -> "CheckpointUri":
        """Parse a checkpoint URI; raises :class:`UsageError` naming the expected form."""
        text = (value or "").strip()
        m = _URI_RE.match(text)
        if m is None:
            hint = "copy it from `loops checkpoints list` (the URI column), or name it as RUN:NAME"
            if text.startswith(("bt://", "abt://")) and "/sequences/" in text:
                hint = "bt://loops:<run>/sequences/<id> is a routing payload, not a checkpoint"
            elif text and "://" not in text:
                hint = "pass the full URI, e.g. bt://loops:abc1234/sampler_weights/step-100"
            raise UsageError(f"malformed checkpoint URI {value!r}: expected {EXPECTED_FORM}", hint=hint)
        return cls(run_id=m["run"], target=_TARGET_FOR_DIR[m["dir"]], name=m["name"])

    @classmethod
    def is_uri(cls, value: str) -> bool:
        return bool(_URI_RE.match((value or "").strip()))

    @classmethod
    def trainer(cls, run_id: str, name: str) -> "CheckpointUri":
        return cls(run_id, "trainer", name)

    @classmethod
    def sampler(cls, run_id: str, name: str) -> "CheckpointUri":
        return cls(run_id, "sampler", name)

    @property
    def directory(self) -> str:
        """``weights`` or ``sampler_weights``."""
        return _DIR_FOR_TARGET[self.target]

    def __str__(self) -> str:
        return f"bt://loops:{self.run_id}/{self.directory}/{self.name}"


__all__ = ["CheckpointUri", "EXPECTED_FORM", "Target"]
