"""Where a checkpoint download writes: the names it may write (every server-given path checked
before anything is written), the target folder it claims (with the marker that lets a rerun
resume), file hashes, and the errors of a download. api/download.py does the transfer."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterable

from baseten_loops_cli.errors import ExitCode, LoopsError, UsageError

if TYPE_CHECKING:
    from baseten_loops_cli.api.download import RemoteFile

MARKER_NAME = ".loops-download.json"
BUFFER_BYTES = 1 << 20  # bytes per read when hashing a file on disk
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


# ── errors ─────────────────────────────────────────────────────────────────────────────────


class DownloadError(LoopsError):
    """A checkpoint download failed; what was saved stays for a rerun to resume."""


class UnsafePathError(DownloadError):
    """A file name from the server would be written outside the target folder."""


class TargetNotEmptyError(UsageError):
    """The target folder already holds files (and no interrupted download of this checkpoint)."""


class DiskFullError(DownloadError):
    """No space left on the target's device (ENOSPC / EDQUOT) mid download."""


# ── paths ──────────────────────────────────────────────────────────────────────────────────


def safe_relative_path(name: str) -> PurePosixPath:
    """``name`` as a relative path that stays inside the target, or :class:`UnsafePathError`."""
    bad = (
        not name
        or "\x00" in name
        or "\\" in name
        or name.startswith("/")
        or (len(name) > 1 and name[1] == ":")  # C:... on Windows
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise UnsafePathError(
            f"refusing to download {name!r}: the file name would be written outside the target folder",
            hint="Nothing was written. The checkpoint's file list is malformed; report it to the backend's operator.",
        )
    return PurePosixPath(name)


def plan_paths(files: Iterable[RemoteFile]) -> dict[tuple[int, str], PurePosixPath]:
    """Where each file goes under the target. Files of node ranks > 0 whose names collide with
    another rank's go under ``node-<rank>/``; every name is validated first."""
    files = list(files)
    for f in files:
        safe_relative_path(f.relative_file_name)
    counts: dict[str, int] = {}
    for f in files:
        counts[f.relative_file_name] = counts.get(f.relative_file_name, 0) + 1
    out: dict[tuple[int, str], PurePosixPath] = {}
    for f in files:
        rel = PurePosixPath(f.relative_file_name)
        if counts[f.relative_file_name] > 1 and f.node_rank:
            rel = PurePosixPath(f"node-{f.node_rank}") / rel
        if f.key in out:
            raise DownloadError(f"the file list names {f.relative_file_name!r} twice for node rank {f.node_rank}")
        out[f.key] = rel
    return out


def _inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _hex_digest(value: Any) -> str | None:
    """A SHA-256 as 64 lowercase hex digits, or None for anything else."""
    if isinstance(value, str):
        text = value.strip().strip('"').lower()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
            return text
    return None


def file_sha256(path: Path, limit: int | None = None) -> "hashlib._Hash":
    """The SHA-256 state of ``path``'s first ``limit`` bytes (all of it when None)."""
    hasher = hashlib.sha256()
    remaining = limit
    with open(path, "rb", buffering=0) as fh:
        buffer = memoryview(bytearray(BUFFER_BYTES))
        while remaining is None or remaining > 0:
            want = BUFFER_BYTES if remaining is None else min(BUFFER_BYTES, remaining)
            n = fh.readinto(buffer[:want])
            if not n:
                break
            hasher.update(buffer[:n])
            if remaining is not None:
                remaining -= n
    return hasher


# ── target folder ──────────────────────────────────────────────────────────────────────────


def _marker(dest: Path) -> dict | None:
    try:
        data = json.loads((dest / MARKER_NAME).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _write_error(dest: Path, exc: OSError, what: str = "write to") -> LoopsError:
    if exc.errno in _DISK_FULL:
        return DiskFullError(f"no space left on the device of {dest}", hint="Free some space and run the same command again.")
    reason = exc.strerror or type(exc).__name__
    return DownloadError(
        f"cannot {what} {dest}: {reason.lower()}",
        hint="Choose a folder you can write to with -O DIR.",
    )


def prepare_target(dest: Path, checkpoint_id: str, *, force: bool) -> bool:
    """Create ``dest`` if needed and claim it for ``checkpoint_id``.

    Returns True when an interrupted download of the same checkpoint is being resumed.
    Raises :class:`TargetNotEmptyError` for a folder with other content (without ``force``) and a
    :class:`DownloadError` for a target that is a file or cannot be written.
    """
    if dest.exists() and not dest.is_dir():
        raise DownloadError(f"cannot download into {dest}: it is a file, not a folder", hint="Pass another -O DIR.",
                            exit_code=ExitCode.USAGE)
    resuming = False
    if dest.is_dir():
        marker = _marker(dest)
        if marker is not None and marker.get("checkpoint_id") == checkpoint_id:
            resuming = True
        else:
            try:
                has_files = any(dest.iterdir())
            except OSError as exc:
                raise _write_error(dest, exc, "read") from None
            if has_files and not force:
                raise TargetNotEmptyError(
                    f"{dest} is not empty",
                    hint="Download into an empty or new folder with -O DIR, or pass --force to overwrite "
                    "the checkpoint's files there (other files are left alone).",
                )
    try:
        dest.mkdir(parents=True, exist_ok=True)
        if not resuming:
            _write_marker(dest, checkpoint_id)
        elif not os.access(dest, os.W_OK):
            raise PermissionError(errno.EACCES, "Permission denied")
    except OSError as exc:
        raise _write_error(dest, exc) from None
    return resuming


def _write_marker(dest: Path, checkpoint_id: str) -> None:
    tmp = dest / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps({"checkpoint_id": checkpoint_id, "started_at": time.time()}), encoding="utf-8")
    os.replace(tmp, dest / MARKER_NAME)
