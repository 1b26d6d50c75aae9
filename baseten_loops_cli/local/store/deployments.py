"""Deployments: a run's trainer (``kind="trainer"``) and inference deployments made from checkpoints."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time

from baseten_loops_cli.local.store.base import SAMPLER_ACTIVE, StoreBase, new_short_id


@dataclasses.dataclass(frozen=True)
class DeploymentRow:
    """A trainer deployment (``kind="trainer"``) or an inference deployment made from
    checkpoints (``kind="inference"``, with ``model_id`` and ``checkpoint_pks``)."""

    id: str
    kind: str
    run_id: str | None
    model_id: str | None
    name: str | None
    base_model: str
    status: str
    status_reason: str | None
    checkpoint_pks: tuple[str, ...]
    created_at: float
    updated_at: float


SCHEMA = """
CREATE TABLE IF NOT EXISTS deployments (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    run_id TEXT,
    model_id TEXT,
    name TEXT,
    base_model TEXT NOT NULL,
    status TEXT NOT NULL,
    status_reason TEXT,
    checkpoint_pks TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
"""


class DeploymentsTable(StoreBase):
    def create_inference_deployment(
        self, *, name: str, base_model: str, checkpoint_pks: list[str]
    ) -> DeploymentRow:
        now = time.time()
        model_id = new_short_id(8)
        dep_id = self._insert_with_fresh_id(
            new_short_id,
            "INSERT INTO deployments (id, kind, run_id, model_id, name, base_model, status,"
            " checkpoint_pks, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
            lambda i: (i, "inference", None, model_id, name, base_model, SAMPLER_ACTIVE,
                       json.dumps(checkpoint_pks), now, now),
        )
        return self.get_deployment(dep_id)  # type: ignore[return-value]

    def _deployment(self, row: sqlite3.Row | None) -> DeploymentRow | None:
        if row is None:
            return None
        values = {k: row[k] for k in row.keys()}
        values["checkpoint_pks"] = tuple(json.loads(values["checkpoint_pks"] or "[]"))
        return DeploymentRow(**values)

    def get_deployment(self, deployment_id: str) -> DeploymentRow | None:
        return self._deployment(
            self._conn().execute("SELECT * FROM deployments WHERE id = ?", (deployment_id,))
            .fetchone()
        )

    def list_deployments(self, kind: str | None = None) -> list[DeploymentRow]:
        sql = "SELECT * FROM deployments"
        args: tuple = ()
        if kind is not None:
            sql += " WHERE kind = ?"
            args = (kind,)
        rows = self._conn().execute(sql + " ORDER BY created_at DESC", args).fetchall()
        return [self._deployment(r) for r in rows]  # type: ignore[misc]

    def set_deployment_status(
        self, deployment_id: str, status: str, reason: str | None = None
    ) -> None:
        self._update("deployments", "id", deployment_id,
                     {"status": status, "status_reason": reason, "updated_at": time.time()})
