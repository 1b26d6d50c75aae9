"""The run directory: everything a training run leaves on disk, written so nothing is half-written.

    config.yaml        the resolved config (after --set overrides)
    state.json         run id, backend, status, last completed step (atomic rewrite)
    metrics.jsonl      one record per step (and eval records), appended
    checkpoints.jsonl  one record per saved trainer state: the resume points (appended, fsynced)
    samples.jsonl      RL rollouts with their rewards
    reference_logprobs.jsonl  DPO: the reference policy's logprobs of each sequence, scored once

Resume rule: the last line of checkpoints.jsonl is the truth. Steps after it are replayed, so
their metrics are trimmed first; nothing is repeated or skipped.

Durability follows the same rule. A record appended to metrics.jsonl or samples.jsonl is in the
OS's hands when the append returns, so it survives a crash or kill of the process; it is fsynced
(survives a power cut) before a checkpoint record or state.json that covers it is written. An
fsync per step would cost every step a disk flush (tens of ms on a network file system, longer
than a small model's step) to keep records that resume trims anyway.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


_ANOTHER_RUN_DIR = "Pass another --run-dir (a new folder you can write to)."
_STATE_HINT = ("`loops train` writes this file: undo the edit to it, or start over with "
               "`loops train run CONFIG --run-dir NEW_DIR`.")


def _fsync_path(path: Path, *, folder: bool = False) -> None:
    """fsync a file, or a folder's entries, by path; a missing path is skipped. A folder's
    failure is ignored (some file systems refuse to fsync one); a file's is raised."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError:
        if folder:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not folder:
            raise
    finally:
        os.close(fd)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent, folder=True)


def read_jsonl(path: Path) -> list[dict]:
    """Read records; a torn last line (a kill mid-write) is ignored, never fatal."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)

    # ---------------------------------------------------------------- files
    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints_file(self) -> Path:
        return self.path / "checkpoints.jsonl"

    @property
    def samples_file(self) -> Path:
        return self.path / "samples.jsonl"

    @property
    def reference_file(self) -> Path:
        return self.path / "reference_logprobs.jsonl"

    def exists(self) -> bool:
        return self.state_file.exists()

    # ---------------------------------------------------------------- create
    def check_target(self) -> None:
        """Refuse a run directory path that is a file (before anything is provisioned)."""
        from baseten_loops_cli.errors import UsageError

        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"run directory {self.path} is a file, not a folder", hint=_ANOTHER_RUN_DIR)

    def create(self, raw_config: dict, source: Path) -> None:
        import yaml

        from baseten_loops_cli.errors import LoopsError

        self.check_target()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            header = f"# Resolved from {source} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
            atomic_write(self.config_file, header + yaml.safe_dump(raw_config, sort_keys=False))
            self.write_state({"status": "created", "step": 0, "config_source": str(source)})
        except OSError as exc:
            reason = (exc.strerror or type(exc).__name__).lower()
            raise LoopsError(f"cannot create the run directory {self.path}: {reason}", hint=_ANOTHER_RUN_DIR) from None

    # ---------------------------------------------------------------- state
    def read_state(self) -> dict:
        from baseten_loops_cli.errors import ConfigError

        try:
            state = json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            detail = f"{exc.msg} (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
            raise ConfigError(f"{self.state_file}: not valid JSON: {detail}", hint=_STATE_HINT) from None
        if not isinstance(state, dict):
            raise ConfigError(f"{self.state_file}: not a JSON object", hint=_STATE_HINT)
        return state

    def write_state(self, state: dict) -> None:
        self.sync_records()  # state.json (its step, its status) never claims more than is on disk
        atomic_write(self.state_file, json.dumps(state, indent=2, sort_keys=True) + "\n")

    def update_state(self, **changes: Any) -> dict:
        state = self.read_state()
        state.update(changes)
        self.write_state(state)
        return state

    # ---------------------------------------------------------------- records
    def _append(self, path: Path, records: list[dict], *, durable: bool) -> None:
        if not records:
            return
        text = "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in records)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())

    def sync_records(self) -> None:
        """fsync the step records (metrics, samples): before anything that covers them."""
        for path in (self.metrics_file, self.samples_file):
            _fsync_path(path)

    def append_metrics(self, record: dict) -> None:
        self._append(self.metrics_file, [record], durable=False)

    def append_checkpoint(self, record: dict) -> None:
        self.sync_records()  # a resume point never covers records a power cut could lose
        self._append(self.checkpoints_file, [record], durable=True)

    def append_samples(self, records: list[dict]) -> None:
        self._append(self.samples_file, records, durable=False)

    def append_references(self, records: list[dict]) -> None:
        # Scored once per run (each costs a forward pass): durable at once.
        self._append(self.reference_file, records, durable=True)

    def references(self) -> list[dict]:
        """The reference records scored so far. A torn tail (a kill mid-append) is cut off, so
        the next append starts on a line of its own."""
        records = read_jsonl(self.reference_file)
        text = self.reference_file.read_text(encoding="utf-8") if self.reference_file.exists() else ""
        if text and (not text.endswith("\n") or text.count("\n") != len(records)):
            atomic_write(self.reference_file, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        return records

    def metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_file)

    def checkpoints(self) -> list[dict]:
        return read_jsonl(self.checkpoints_file)

    def last_checkpoint(self) -> dict | None:
        records = self.checkpoints()
        return records[-1] if records else None

    def trim_after(self, step: int) -> None:
        """Drop metric and sample records of steps after ``step`` (they will be replayed)."""
        for path in (self.metrics_file, self.samples_file):
            if not path.exists():
                continue
            kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
            atomic_write(path, "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in kept))
