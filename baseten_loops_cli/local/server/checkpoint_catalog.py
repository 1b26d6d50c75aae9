"""Saved checkpoints as the control plane and the file links see them (``CheckpointCatalog``):
lookups by id or ``bt://`` path, listings, the check a sampler checkpoint passes before it is
served, a page of presigned file links, and TTL expiry. Routes call this, never the store;
the rows it returns (``CheckpointRow``) are rendered by ``schemas.checkpoint_view``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.store import CheckpointRow
from baseten_loops_cli.local.server.checkpoints import CheckpointFiles, list_files, require_bt_path
from baseten_loops_cli.local.server.errors import ApiError, bad_request, not_found
from baseten_loops_cli.local.server.files import Presigner

__all__ = ["CheckpointCatalog", "CheckpointRow", "FilePage"]


@dataclass(frozen=True)
class FilePage:
    """One page of a checkpoint's files (``GET /v1/loops/checkpoints/{id}/files``)."""

    entries: list[dict[str, Any]]
    next_page_token: int | None
    total_count: int


class CheckpointCatalog:
    def __init__(self, store: st.Store, files: CheckpointFiles, presigner: Presigner) -> None:
        self.store = store
        self.files = files
        self.presigner = presigner

    # ── lookup ──

    def find(self, pk: str) -> CheckpointRow | None:
        """The checkpoint with primary key ``pk``; None once deleted or expired."""
        return self.store.get_checkpoint(pk)

    def get(self, pk: str) -> CheckpointRow:
        """The checkpoint with primary key ``pk``, or a 404 saying where ids come from."""
        cp = self.store.get_checkpoint(pk)
        if cp is None:
            raise not_found("checkpoint", pk, "Checkpoint ids are the 'id' field of "
                                              "GET /v1/loops/checkpoints?run_id=<run>.")
        return cp

    def search(self, *, run_id: str | None = None, base_model: str | None = None,
               checkpoint_path: str | None = None) -> list[CheckpointRow]:
        """A run's checkpoints, a base model's, or the one a ``bt://`` path names (the
        first filter given)."""
        if run_id is not None:
            return self.store.list_checkpoints(run_id=run_id)
        if base_model is not None:
            return self.store.list_checkpoints(base_model=base_model)
        assert checkpoint_path is not None
        ref = require_bt_path(checkpoint_path)
        cp = self.store.find_checkpoint(ref.run_id, ref.target, ref.name)
        return [cp] if cp else []

    def check_servable(self, checkpoint_path: str, run_id: str | None) -> None:
        """``POST /v1/loops/checkpoints/validate``: 4xx unless ``checkpoint_path`` names
        sampler weights (on ``run_id``'s base model, when given)."""
        ref = require_bt_path(checkpoint_path)
        cp = self.store.find_checkpoint(ref.run_id, ref.target, ref.name)
        if cp is None:
            raise ApiError(404, f"No checkpoint {checkpoint_path}. List this run's with "
                                f"GET /v1/loops/checkpoints?run_id={ref.run_id}.",
                           "CheckpointNotFound")
        if cp.target != st.TARGET_SAMPLER:
            raise bad_request(f"{checkpoint_path} is trainer state; samplers serve sampler "
                              "weights (save_weights_for_sampler).", "WrongCheckpointTarget")
        if run_id is not None:
            run = self.store.get_run(run_id)
            if run is None:
                raise bad_request(f"Unknown run_id {run_id!r}.", "RunNotFound")
            if run.base_model != cp.base_model:
                raise bad_request(f"{checkpoint_path} was trained on {cp.base_model}; run "
                                  f"{run.id} uses {run.base_model}.", "BaseModelMismatch")

    # ── files ──

    def folder(self, cp: CheckpointRow) -> Path:
        """Where ``cp``'s files are on disk."""
        return self.files.absolute(cp.storage_dir)

    def file_page(self, cp: CheckpointRow, base_url: str, offset: int,
                  page_size: int) -> FilePage:
        """Presigned links to ``cp``'s files ``offset`` .. ``offset + page_size``."""
        root = self.folder(cp)
        names = list_files(root)
        now = time.time()
        entries = []
        for rel in names[offset:offset + page_size]:
            stat = (root / rel).stat()
            entries.append({
                "url": self.presigner.url(base_url, cp.pk, rel.as_posix(), now),
                "relative_file_name": rel.as_posix(),
                "node_rank": 0,
                "size_bytes": stat.st_size,
                "last_modified": st.iso(stat.st_mtime),
                # Not in the hosted schema (clients ignore unknown fields): lets a downloader
                # verify what it received, which a byte flipped in transit would fail.
                "sha256": cp.manifest.get(rel.as_posix()),
            })
        next_token = offset + page_size if offset + page_size < len(names) else None
        return FilePage(entries, next_token, len(names))

    # ── retention ──

    def expire(self, now: float) -> None:
        """Janitor tick: delete the checkpoints whose TTL has passed (row, then files), and
        say so in their run's logs."""
        for cp in self.store.expired_checkpoints(now):
            self.store.delete_checkpoint(cp.pk)
            self.files.remove(cp.storage_dir)
            run = self.store.get_run(cp.run_id)
            if run is not None:
                self.store.append_log(run.deployment_id, f"Checkpoint {cp.bt_path} expired "
                                                         "(TTL) and was deleted.")
