"""Runs and their lifecycle (a run, its trainer deployment and its samplers go down together)."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from typing import Any

from baseten_loops_cli.local.store.base import (DEPLOY_CREATED, DEPLOY_STOPPED, RUN_ACTIVE, RUN_INACTIVE, SAMPLER_INACTIVE, StoreBase, new_short_id)


@dataclasses.dataclass(frozen=True)
class RunRow:
    id: str
    session_id: str
    team_id: str | None
    name: str
    base_model: str
    lora_rank: int
    max_seq_len: int
    seed: int | None
    scale_down_delay_seconds: int
    availability_model: str
    replicas: int
    init_path: str | None
    deployment_id: str
    status: str
    policy_version: int
    # The sampler-weights checkpoint last published with bump_version (what the paired
    # sampler serves) and the policy version it was published at (0 = serve the base).
    published_checkpoint_pk: str | None
    published_version: int
    # forward_backward ops applied since the last optim_step: gradients that exist only in
    # memory. Persisted so a restart can tell the next optim_step they were lost.
    pending_grad_ops: int
    gradients_lost: int
    created_at: float
    last_active_at: float
    deactivated_at: float | None


SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    team_id TEXT,
    name TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER NOT NULL,
    max_seq_len INTEGER NOT NULL,
    seed INTEGER,
    scale_down_delay_seconds INTEGER NOT NULL,
    availability_model TEXT NOT NULL,
    replicas INTEGER NOT NULL,
    init_path TEXT,
    deployment_id TEXT NOT NULL,
    status TEXT NOT NULL,
    policy_version INTEGER NOT NULL DEFAULT 0,
    published_checkpoint_pk TEXT,
    published_version INTEGER NOT NULL DEFAULT 0,
    pending_grad_ops INTEGER NOT NULL DEFAULT 0,
    gradients_lost INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    deactivated_at REAL
);
"""


class RunsTable(StoreBase):
    def create_run(
        self,
        *,
        session_id: str,
        team_id: str | None,
        name: str,
        base_model: str,
        lora_rank: int,
        max_seq_len: int,
        seed: int | None,
        scale_down_delay_seconds: int,
        availability_model: str,
        replicas: int,
        init_path: str | None,
    ) -> RunRow:
        """Create a run and its trainer deployment (status CREATED) in one transaction."""
        now = time.time()
        for _ in range(20):
            run_id, deployment_id = new_short_id(), new_short_id()
            try:
                with self._tx() as db:
                    db.execute(
                        "INSERT INTO deployments (id, kind, run_id, model_id, name, base_model,"
                        " status, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?)",
                        (deployment_id, "trainer", run_id, None, name, base_model,
                         DEPLOY_CREATED, now, now),
                    )
                    db.execute(
                        "INSERT INTO runs (id, session_id, team_id, name, base_model, lora_rank,"
                        " max_seq_len, seed, scale_down_delay_seconds, availability_model,"
                        " replicas, init_path, deployment_id, status, policy_version,"
                        " created_at, last_active_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,0,?,?)",
                        (run_id, session_id, team_id, name, base_model, lora_rank, max_seq_len,
                         seed, scale_down_delay_seconds, availability_model, replicas,
                         init_path, deployment_id, RUN_ACTIVE, now, now),
                    )
                    db.execute(
                        "INSERT INTO usage (owner_id, owner_kind) VALUES (?, 'run')", (run_id,)
                    )
                return self.get_run(run_id)  # type: ignore[return-value]
            except sqlite3.IntegrityError:
                continue
        raise RuntimeError("could not allocate a unique run id")  # pragma: no cover

    def get_run(self, run_id: str) -> RunRow | None:
        return self._one(RunRow, "SELECT * FROM runs WHERE id = ?", (run_id,))

    def list_runs(
        self, *, run_id: str | None = None, base_model: str | None = None,
        team_id: str | None = None, status: str | None = None,
    ) -> list[RunRow]:
        clauses, args = [], []
        for column, value in (("id", run_id), ("base_model", base_model),
                              ("team_id", team_id), ("status", status)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return self._all(RunRow, f"SELECT * FROM runs {where} ORDER BY created_at DESC", args)

    def run_base_models(self) -> list[str]:
        """Every base model a run was created on (names and local folders), first used first."""
        rows = self._conn().execute(
            "SELECT base_model FROM runs GROUP BY base_model ORDER BY MIN(created_at)").fetchall()
        return [row[0] for row in rows]

    def update_run(self, run_id: str, **fields: Any) -> None:
        self._update("runs", "id", run_id, fields)

    def touch_run(self, run_id: str, now: float | None = None) -> None:
        self.update_run(run_id, last_active_at=now or time.time())

    def deactivate_run(self, run_id: str, deployment_id: str) -> None:
        """A run, its trainer deployment and its paired samplers go down together (one
        transaction: a crash never leaves an inactive run with a live trainer or sampler)."""
        now = time.time()
        with self._tx() as db:
            db.execute("UPDATE runs SET status = ?, deactivated_at = ? WHERE id = ?",
                       (RUN_INACTIVE, now, run_id))
            db.execute("UPDATE deployments SET status = ?, status_reason = ?, updated_at = ?"
                       " WHERE id = ?", (DEPLOY_STOPPED, "deactivated", now, deployment_id))
            db.execute("UPDATE samplers SET status = ?, deactivated_at = ? WHERE run_id = ?"
                       " AND status != ?", (SAMPLER_INACTIVE, now, run_id, SAMPLER_INACTIVE))
