"""Where checkpoint files live on disk, and how ``bt://`` paths map onto them.

Layout under the data dir::

    checkpoints/<run_id>/weights/<name>/           trainer state (adapter + optimizer + step)
    checkpoints/<run_id>/sampler_weights/<name>/   plain PEFT adapter, what samplers serve
    runs/<run_id>/live/                            the run's own state while scaled to zero

Saving a name that exists replaces it atomically (the engine writes a sibling folder and
swaps it in with renames), so a reader (a download, a sampler loading the adapter) never
sees a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.server.errors import bad_request

_BT_PATH = re.compile(
    r"^bt://loops:(?P<run>[A-Za-z0-9_-]+)/(?P<folder>weights|sampler_weights)/(?P<name>[^/]+)/?$"
)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

FOLDER_FOR_TARGET = {st.TARGET_TRAINER: "weights", st.TARGET_SAMPLER: "sampler_weights"}
TARGET_FOR_FOLDER = {v: k for k, v in FOLDER_FOR_TARGET.items()}


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    target: str
    name: str

    @property
    def uri(self) -> str:
        return f"bt://loops:{self.run_id}/{FOLDER_FOR_TARGET[self.target]}/{self.name}"


def parse_bt_path(path: str) -> CheckpointRef | None:
    """``bt://loops:<run>/(weights|sampler_weights)/<name>`` -> ref; None if not that shape."""
    match = _BT_PATH.match(path.strip())
    if match is None:
        return None
    return CheckpointRef(match["run"], TARGET_FOR_FOLDER[match["folder"]], match["name"])


def require_bt_path(path: str, *, what: str = "checkpoint_path") -> CheckpointRef:
    ref = parse_bt_path(path)
    if ref is None:
        raise bad_request(
            f"{what} {path!r} is not a Loops checkpoint path. Use "
            "bt://loops:<run_id>/weights/<name> (trainer state) or "
            "bt://loops:<run_id>/sampler_weights/<name> (sampler weights).",
            "InvalidCheckpointPath",
        )
    return ref


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"Checkpoint name {name!r} is not allowed: use 1-200 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (e.g. 'step-100').",
            "InvalidCheckpointName",
        )
    return name


class CheckpointFiles:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def relative_dir(self, ref: CheckpointRef) -> str:
        return f"checkpoints/{ref.run_id}/{FOLDER_FOR_TARGET[ref.target]}/{ref.name}"

    def absolute(self, storage_dir: str) -> Path:
        return self.data_dir / storage_dir

    def live_state_dir(self, run_id: str) -> Path:
        return self.data_dir / "runs" / run_id / "live"

    def publish(self, ref: CheckpointRef, save: Callable[[Path], object]
                ) -> tuple[str, int, dict[str, str]]:
        """Run the engine's (atomic) ``save`` into the checkpoint's folder.

        Returns (storage dir relative to the data dir, total size in bytes, manifest of
        sha256 per file). Runs on a compute thread, while the files are still in the
        page cache, so hashing them costs little.
        """
        relative = self.relative_dir(ref)
        target = self.absolute(relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        save(target)
        return relative, dir_size(target), manifest(target)

    def remove(self, storage_dir: str) -> None:
        shutil.rmtree(self.absolute(storage_dir), ignore_errors=True)


def list_files(root: Path) -> list[Path]:
    """Every regular file under ``root``, sorted, relative to ``root``. Symlinks are left
    out: a checkpoint folder only ever holds what the engine wrote."""
    if not root.is_dir():
        return []
    return [p.relative_to(root) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()]


def manifest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            out[path.relative_to(root).as_posix()] = digest.hexdigest()
    return out


def dir_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
