"""Checkpoints: a run's saved trainer state and sampler weights, with their expiry."""

from __future__ import annotations

import dataclasses
import json
import time

from baseten_loops_cli.local.store.base import StoreBase, TARGET_TRAINER, new_checkpoint_pk


@dataclasses.dataclass(frozen=True)
class CheckpointRow:
    pk: str
    run_id: str
    name: str
    target: str
    base_model: str
    lora_rank: int
    policy_version: int
    size_bytes: int
    storage_dir: str  # relative to the data dir
    created_at: float
    expires_at: float | None
    # {relative file path: sha256 hex} computed when saved, so downloads can be verified.
    manifest: dict[str, str]

    @property
    def bt_path(self) -> str:
        folder = "weights" if self.target == TARGET_TRAINER else "sampler_weights"
        return f"bt://loops:{self.run_id}/{folder}/{self.name}"


SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    pk TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    name TEXT NOT NULL,
    target TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    storage_dir TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    manifest TEXT NOT NULL DEFAULT '{}',
    UNIQUE (run_id, target, name)
);
"""


class CheckpointsTable(StoreBase):
    def upsert_checkpoint(
        self,
        *,
        run_id: str,
        name: str,
        target: str,
        base_model: str,
        lora_rank: int,
        policy_version: int,
        size_bytes: int,
        storage_dir: str,
        expires_at: float | None,
        manifest: dict[str, str] | None = None,
    ) -> CheckpointRow:
        """Record a save. Saving a name again replaces that checkpoint (same pk, new
        files, new time): a dedicated sampler re-reads one directory per name, and the
        SDK resolves names to exactly one checkpoint per target."""
        now = time.time()
        existing = self._one(
            CheckpointRow,
            "SELECT * FROM checkpoints WHERE run_id = ? AND target = ? AND name = ?",
            (run_id, target, name),
        )
        if existing is not None:
            self._update("checkpoints", "pk", existing.pk, {
                "lora_rank": lora_rank, "policy_version": policy_version,
                "size_bytes": size_bytes, "storage_dir": storage_dir,
                "created_at": now, "expires_at": expires_at,
                "manifest": json.dumps(manifest or {}),
            })
            return self.get_checkpoint(existing.pk)  # type: ignore[return-value]
        pk = self._insert_with_fresh_id(
            new_checkpoint_pk,
            "INSERT INTO checkpoints (pk, run_id, name, target, base_model, lora_rank,"
            " policy_version, size_bytes, storage_dir, created_at, expires_at, manifest)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            lambda i: (i, run_id, name, target, base_model, lora_rank, policy_version,
                       size_bytes, storage_dir, now, expires_at, json.dumps(manifest or {})),
        )
        return self.get_checkpoint(pk)  # type: ignore[return-value]

    def get_checkpoint(self, pk: str) -> CheckpointRow | None:
        return self._one(CheckpointRow, "SELECT * FROM checkpoints WHERE pk = ?", (pk,))

    def find_checkpoint(self, run_id: str, target: str, name: str) -> CheckpointRow | None:
        return self._one(
            CheckpointRow,
            "SELECT * FROM checkpoints WHERE run_id = ? AND target = ? AND name = ?",
            (run_id, target, name),
        )

    def list_checkpoints(
        self, *, run_id: str | None = None, base_model: str | None = None
    ) -> list[CheckpointRow]:
        """Newest first, as the hosted API returns them."""
        if run_id is not None:
            return self._all(CheckpointRow,
                             "SELECT * FROM checkpoints WHERE run_id = ?"
                             " ORDER BY created_at DESC, pk", (run_id,))
        if base_model is not None:
            return self._all(CheckpointRow,
                             "SELECT * FROM checkpoints WHERE base_model = ?"
                             " ORDER BY created_at DESC, pk", (base_model,))
        return self._all(CheckpointRow, "SELECT * FROM checkpoints ORDER BY created_at DESC")

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        return self._all(CheckpointRow,
                         "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL"
                         " AND expires_at <= ?", (now,))

    def delete_checkpoint(self, pk: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE pk = ?", (pk,))
