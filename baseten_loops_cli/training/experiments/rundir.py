"""The run directory: everything a training run leaves on disk, written so nothing is half-written.

    config.yaml        the resolved config (after --set overrides)
    state.json         run id, backend, status, last completed step (atomic rewrite)
    metrics.jsonl      one record per step (and eval records), appended
    checkpoints.jsonl  one record per saved trainer state: the resume points (appended, fsynced)
    samples.jsonl      RL rollouts with their rewards
    reference_logprobs.jsonl  DPO: the reference policy's logprobs of each sequence, scored once
    eval.json, eval.txt  the config's `eval:` table of the final checkpoint (training/evaluation/final_eval.py)
    .lock              held (flock) by the one process training in it (`train run|resume`)

A sweep folder (training/experiments/sweep.py) holds ``sweep.json`` (its index) and one run directory per
point. :func:`read_run` and :func:`run_dirs` are the one reader of run directories: `loops train
plot` and `loops train compare` both go through them.

Resume rule: the last line of checkpoints.jsonl is the truth. Steps after it are replayed, so
their metrics are trimmed first; nothing is repeated or skipped.

Durability follows the same rule. A record appended to metrics.jsonl or samples.jsonl is in the
OS's hands when the append returns, so it survives a crash or kill of the process; it is fsynced
(survives a power cut) before a checkpoint record or state.json that covers it is written. An
fsync per step would cost every step a disk flush (tens of ms on a network file system, longer
than a small model's step) to keep records that resume trims anyway.
"""

from __future__ import annotations

import errno
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


SWEEP_INDEX = "sweep.json"


class RunDirBusy(Exception):
    """Another process trains in this run directory (it holds the lock)."""

    def __init__(self, path: Path, pid: int | None):
        super().__init__(f"{path} is in use by another loops process" + (f" (pid {pid})" if pid else ""))
        self.path = path
        self.pid = pid


class _RunFile:
    """A file of every run directory, by name: ``run.metrics_file`` is ``run.path / "metrics.jsonl"``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, run: "RunDir", owner: type | None = None) -> Path:
        return run.path / self.name


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock_fd: int | None = None

    # ---------------------------------------------------------------- files
    config_file = _RunFile("config.yaml")
    state_file = _RunFile("state.json")
    metrics_file = _RunFile("metrics.jsonl")
    checkpoints_file = _RunFile("checkpoints.jsonl")
    samples_file = _RunFile("samples.jsonl")
    reference_file = _RunFile("reference_logprobs.jsonl")

    def exists(self) -> bool:
        return self.state_file.exists()

    # ---------------------------------------------------------------- one writer at a time
    @property
    def lock_file(self) -> Path:
        return self.path / ".lock"

    def acquire(self) -> None:
        """Take the run directory for this process (``flock`` on .lock, released by the kernel
        when the process ends, however it ends). Raises :class:`RunDirBusy` when another process
        holds it: two processes training one run directory would each replay the other's steps.
        Where ``fcntl`` does not exist (Windows) nothing is locked."""
        try:
            import fcntl
        except ImportError:
            return
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirBusy(self.path, self.lock_holder()) from None
            return  # a file system without flock (some network mounts): train unlocked, as before
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def lock_holder(self) -> int | None:
        """The pid of the process that trains here now, or None when none does."""
        try:
            import fcntl
        except ImportError:
            return None
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                text = os.read(fd, 32).decode(errors="replace").strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

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


# -------------------------------------------------------------------- the reader
class RunRecord:
    """What one run directory says about its run, read once: `train plot` and `train compare`
    both see runs through this (and :func:`run_dirs`)."""

    def __init__(self, path: Path) -> None:
        import yaml

        self.rundir = RunDir(path)
        self.path = self.rundir.path
        self.state: dict = self.rundir.read_state()
        try:
            raw = yaml.safe_load(self.rundir.config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):
            raw = None
        self.config: dict = raw if isinstance(raw, dict) else {}
        records = self.rundir.metrics()
        self.metrics: list[dict] = [r for r in records if not r.get("final")]  # one per step
        self.final: dict = {}  # the end-of-run eval record(s), merged
        for r in records:
            if r.get("final"):
                self.final.update({k: v for k, v in r.items() if k != "final"})
        try:
            doc = json.loads((self.path / "eval.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        self.eval: dict | None = doc if isinstance(doc, dict) else None

    @property
    def label(self) -> str:
        return str(self.path).rstrip("/") or str(self.path)

    @property
    def kind(self) -> str | None:
        kind = self.config.get("kind")
        return kind if isinstance(kind, str) else None

    @property
    def status(self) -> str:
        return str(self.state.get("status") or "created")

    @property
    def steps(self) -> int:
        return int(self.metrics[-1]["step"]) if self.metrics else 0

    def numeric_names(self) -> list[str]:
        """Every numeric metric the step records carry (``step`` aside), sorted."""
        return sorted({k for r in self.metrics for k, v in r.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "final")})

    def values(self, name: str) -> list[float]:
        import math

        return [float(r[name]) for r in self.metrics
                if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool)
                and not math.isnan(float(r[name]))]

    def wall_seconds(self) -> float | None:
        """Training time: the sum of the steps' wall times (resumes add only their own steps)."""
        times = self.values("step_time_s")
        return sum(times) if times else None

    def tokens(self) -> int | None:
        counts = self.values("tokens")
        return int(sum(counts)) if counts else None

    def eval_figures(self) -> dict[str, float]:
        """The `eval:` table's figures of the trained checkpoint (eval.json), ``eval.METRIC``."""
        if not self.eval:
            return {}
        rows = [r for r in self.eval.get("results") or [] if isinstance(r, dict) and not r.get("base")]
        figures = {}
        for key, value in ((rows[-1].get("metrics") or {}) if rows else {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                figures[f"eval.{key}"] = float(value)
        return figures


def is_sweep_dir(path: Path) -> bool:
    return (Path(path) / SWEEP_INDEX).is_file()


def sweep_run_paths(sweep_dir: Path) -> list[Path]:
    """The run directories a sweep's index lists, in its order."""
    from baseten_loops_cli.errors import ConfigError

    index_file = Path(sweep_dir) / SWEEP_INDEX
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
        return [Path(sweep_dir) / str(run["dir"]) for run in index["runs"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{index_file}: not a sweep index ({type(exc).__name__})",
                          hint="`loops train sweep` writes this file: undo the edit to it.") from None


def run_dirs(paths: list[Path], *, started_only: bool = False) -> list[Path]:
    """Run directories from the command line: a run directory stands for itself, a sweep folder
    for its runs (those that started, with ``started_only``). Anything else is a usage error."""
    from baseten_loops_cli.errors import UsageError

    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if RunDir(path).exists():
            found.append(path)
        elif is_sweep_dir(path):
            runs = sweep_run_paths(path)
            found += [p for p in runs if RunDir(p).exists()] if started_only else runs
        else:
            what = "no such folder" if not path.exists() else ("a file" if not path.is_dir() else "no state.json or sweep.json")
            raise UsageError(f"{path} is neither a run directory nor a sweep folder ({what})",
                             hint="Pass the --run-dir of `loops train run` or the folder of `loops train sweep`.")
    return found
