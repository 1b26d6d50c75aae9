"""Samplers: a run's paired sampler and standalone ones (a checkpoint or a base model)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from baseten_loops_cli.local.store.base import (SAMPLER_ACTIVE, SAMPLER_INACTIVE, StoreBase, new_short_id)


@dataclasses.dataclass(frozen=True)
class SamplerRow:
    id: str
    session_id: str | None
    team_id: str | None
    run_id: str | None
    base_model: str
    model_path: str | None
    checkpoint_pk: str | None
    max_seq_length: int | None
    num_replicas: int | None
    model_id: str
    deployment_id: str
    status: str
    policy_version: int
    live_checkpoint_pk: str | None
    scale_down_delay_seconds: int
    created_at: float
    last_active_at: float
    deactivated_at: float | None


SCHEMA = """
CREATE TABLE IF NOT EXISTS samplers (
    id TEXT PRIMARY KEY,
    session_id TEXT,
    team_id TEXT,
    run_id TEXT,
    base_model TEXT NOT NULL,
    model_path TEXT,
    checkpoint_pk TEXT,
    max_seq_length INTEGER,
    num_replicas INTEGER,
    model_id TEXT NOT NULL,
    deployment_id TEXT NOT NULL,
    status TEXT NOT NULL,
    policy_version INTEGER NOT NULL DEFAULT 0,
    live_checkpoint_pk TEXT,
    scale_down_delay_seconds INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    deactivated_at REAL
);
CREATE INDEX IF NOT EXISTS samplers_by_run ON samplers(run_id);
"""


class SamplersTable(StoreBase):
    def create_sampler(
        self,
        *,
        session_id: str | None,
        team_id: str | None,
        run_id: str | None,
        base_model: str,
        model_path: str | None,
        checkpoint_pk: str | None,
        max_seq_length: int | None,
        num_replicas: int | None,
        scale_down_delay_seconds: int,
        policy_version: int = 0,
    ) -> SamplerRow:
        now = time.time()
        model_id, deployment_id = new_short_id(8), new_short_id()
        sid = self._insert_with_fresh_id(
            new_short_id,
            "INSERT INTO samplers (id, session_id, team_id, run_id, base_model, model_path,"
            " checkpoint_pk, max_seq_length, num_replicas, model_id, deployment_id, status,"
            " policy_version, live_checkpoint_pk, scale_down_delay_seconds, created_at,"
            " last_active_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            lambda i: (i, session_id, team_id, run_id, base_model, model_path, checkpoint_pk,
                       max_seq_length, num_replicas, model_id, deployment_id, SAMPLER_ACTIVE,
                       policy_version, checkpoint_pk, scale_down_delay_seconds, now, now),
        )
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO usage (owner_id, owner_kind) VALUES (?, 'sampler')",
                       (sid,))
        return self.get_sampler(sid)  # type: ignore[return-value]

    def get_sampler(self, sampler_id: str) -> SamplerRow | None:
        return self._one(SamplerRow, "SELECT * FROM samplers WHERE id = ?", (sampler_id,))

    def get_sampler_by_model(self, model_id: str, deployment_id: str) -> SamplerRow | None:
        return self._one(SamplerRow,
                         "SELECT * FROM samplers WHERE model_id = ? AND deployment_id = ?",
                         (model_id, deployment_id))

    def paired_sampler(self, run_id: str, *, live_only: bool = True) -> SamplerRow | None:
        sql = "SELECT * FROM samplers WHERE run_id = ?"
        if live_only:
            sql += f" AND status != '{SAMPLER_INACTIVE}'"
        return self._one(SamplerRow, sql + " ORDER BY created_at DESC LIMIT 1", (run_id,))

    def list_samplers(self, team_id: str | None = None) -> list[SamplerRow]:
        if team_id is None:
            return self._all(SamplerRow, "SELECT * FROM samplers ORDER BY created_at DESC")
        return self._all(SamplerRow,
                         "SELECT * FROM samplers WHERE team_id = ? ORDER BY created_at DESC",
                         (team_id,))

    def update_sampler(self, sampler_id: str, **fields: Any) -> None:
        self._update("samplers", "id", sampler_id, fields)
