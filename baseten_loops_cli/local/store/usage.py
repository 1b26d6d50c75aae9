"""Usage counters per allocation (totals, and by the minute for `usage --since`), and the sampling of
a run's checkpoints by others."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from baseten_loops_cli.local.store.base import StoreBase


@dataclasses.dataclass(frozen=True)
class UsageRow:
    owner_id: str
    owner_kind: str  # "run" | "sampler" | "deployment"
    tokens_trained: int
    tokens_sampled: int
    compute_seconds: float
    operations: int
    sample_requests: int


SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    owner_id TEXT PRIMARY KEY,
    owner_kind TEXT NOT NULL,
    tokens_trained INTEGER NOT NULL DEFAULT 0,
    tokens_sampled INTEGER NOT NULL DEFAULT 0,
    compute_seconds REAL NOT NULL DEFAULT 0,
    operations INTEGER NOT NULL DEFAULT 0,
    sample_requests INTEGER NOT NULL DEFAULT 0
);
-- Sampling of a run's checkpoints by someone other than the run itself (a standalone sampler:
-- `loops sample`, `loops eval`; a deployment), so `loops usage --by-run` counts it for the run
-- while each allocation's own row keeps what it served.
CREATE TABLE IF NOT EXISTS checkpoint_sampling (
    run_id TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    owner_kind TEXT NOT NULL,
    tokens_sampled INTEGER NOT NULL DEFAULT 0,
    sample_requests INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, owner_id)
);
-- The same counters by the minute they were used (epoch seconds, a multiple of 60), so
-- `loops usage --since/--until` can sum a window. run_id: the run the use counts for (the owner
-- itself, or the run whose checkpoint a sampler or deployment served; '' when none).
CREATE TABLE IF NOT EXISTS usage_minutes (
    owner_id TEXT NOT NULL,
    owner_kind TEXT NOT NULL,
    run_id TEXT NOT NULL DEFAULT '',
    minute INTEGER NOT NULL,
    tokens_trained INTEGER NOT NULL DEFAULT 0,
    tokens_sampled INTEGER NOT NULL DEFAULT 0,
    compute_seconds REAL NOT NULL DEFAULT 0,
    operations INTEGER NOT NULL DEFAULT 0,
    sample_requests INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner_id, run_id, minute)
);
CREATE INDEX IF NOT EXISTS usage_minutes_by_minute ON usage_minutes(minute);
"""


class UsageTable(StoreBase):
    def add_usage(
        self, owner_id: str, owner_kind: str, *, tokens_trained: int = 0,
        tokens_sampled: int = 0, compute_seconds: float = 0.0, operations: int = 0,
        sample_requests: int = 0, checkpoint_pk: str | None = None,
    ) -> None:
        """Add to an owner's counters. ``checkpoint_pk``: the checkpoint a sampling request
        served; when the owner is not a run (a standalone sampler, a deployment), the tokens
        are also counted for the checkpoint's run (:meth:`usage_report`)."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO usage (owner_id, owner_kind) VALUES (?, ?)",
                       (owner_id, owner_kind))
            db.execute(
                "UPDATE usage SET tokens_trained = tokens_trained + ?,"
                " tokens_sampled = tokens_sampled + ?, compute_seconds = compute_seconds + ?,"
                " operations = operations + ?, sample_requests = sample_requests + ?"
                " WHERE owner_id = ?",
                (tokens_trained, tokens_sampled, compute_seconds, operations, sample_requests,
                 owner_id),
            )
            found = None
            if checkpoint_pk is not None and owner_kind != "run":
                found = db.execute("SELECT run_id FROM checkpoints WHERE pk = ?", (checkpoint_pk,)).fetchone()
            run_id = owner_id if owner_kind == "run" else (found[0] if found else "")
            db.execute(
                "INSERT INTO usage_minutes (owner_id, owner_kind, run_id, minute, tokens_trained, tokens_sampled,"
                " compute_seconds, operations, sample_requests) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (owner_id, run_id, minute) DO UPDATE SET"
                " tokens_trained = tokens_trained + excluded.tokens_trained,"
                " tokens_sampled = tokens_sampled + excluded.tokens_sampled,"
                " compute_seconds = compute_seconds + excluded.compute_seconds,"
                " operations = operations + excluded.operations,"
                " sample_requests = sample_requests + excluded.sample_requests",
                (owner_id, owner_kind, run_id, int(time.time()) // 60 * 60, tokens_trained, tokens_sampled,
                 compute_seconds, operations, sample_requests),
            )
            if found is None:
                return
            db.execute("INSERT OR IGNORE INTO checkpoint_sampling (run_id, owner_id, owner_kind)"
                       " VALUES (?, ?, ?)", (found[0], owner_id, owner_kind))
            db.execute("UPDATE checkpoint_sampling SET tokens_sampled = tokens_sampled + ?,"
                       " sample_requests = sample_requests + ? WHERE run_id = ? AND owner_id = ?",
                       (tokens_sampled, sample_requests, found[0], owner_id))

    def usage_report(self, owner_id: str | None = None) -> list[dict[str, Any]]:
        """``GET /v1/local/usage``: every owner's counters (or one owner's). A run's row also
        has ``checkpoints_sampled_by``: who else sampled its checkpoints (standalone samplers,
        deployments), with their tokens and requests."""
        by_run: dict[str, list[dict[str, Any]]] = {}
        for run_id, other, kind, tokens, requests in self._conn().execute(
                "SELECT run_id, owner_id, owner_kind, tokens_sampled, sample_requests"
                " FROM checkpoint_sampling ORDER BY run_id, owner_kind, owner_id"):
            by_run.setdefault(run_id, []).append({"owner_id": other, "owner_kind": kind,
                                                  "tokens_sampled": tokens, "sample_requests": requests})
        rows = [u for u in self.list_usage() if owner_id in (None, u.owner_id)]
        known = {u.owner_id for u in self.list_usage()}
        for run_id in by_run.keys() - known:  # a run whose checkpoints were sampled, nothing else
            if owner_id in (None, run_id):
                rows.append(UsageRow(run_id, "run", 0, 0, 0.0, 0, 0))
        out = []
        for u in rows:
            row: dict[str, Any] = {
                "owner_id": u.owner_id, "owner_kind": u.owner_kind,
                "tokens_trained": u.tokens_trained, "tokens_sampled": u.tokens_sampled,
                "compute_seconds": round(u.compute_seconds, 3), "operations": u.operations,
                "sample_requests": u.sample_requests}
            if u.owner_kind == "run":
                row["checkpoints_sampled_by"] = by_run.get(u.owner_id, [])
            out.append(row)
        return out

    def usage_periods(self, since: float, until: float, period_s: int) -> list[dict[str, Any]]:
        """The counters of the minutes that overlap ``[since, until)`` (epoch seconds: usage is
        kept to the minute) summed per owner, run and period of ``period_s`` seconds
        (UTC-aligned), oldest first."""
        first, end = int(since) // 60 * 60, int(until)
        rows = self._conn().execute(
            "SELECT (minute / ?) * ? AS start, owner_id, owner_kind, run_id, SUM(tokens_trained),"
            " SUM(tokens_sampled), SUM(compute_seconds), SUM(operations), SUM(sample_requests)"
            " FROM usage_minutes WHERE minute >= ? AND minute < ?"
            " GROUP BY start, owner_id, owner_kind, run_id ORDER BY start, owner_kind DESC, owner_id, run_id",
            (period_s, period_s, first, end)).fetchall()
        keys = ("start", "owner_id", "owner_kind", "run_id", "tokens_trained", "tokens_sampled",
                "compute_seconds", "operations", "sample_requests")
        out = [dict(zip(keys, row)) for row in rows]
        for row in out:
            row["compute_seconds"] = round(row["compute_seconds"], 3)
            row["run_id"] = row["run_id"] or None
        return out

    def get_usage(self, owner_id: str) -> UsageRow | None:
        return self._one(UsageRow, "SELECT * FROM usage WHERE owner_id = ?", (owner_id,))

    def list_usage(self) -> list[UsageRow]:
        return self._all(UsageRow, "SELECT * FROM usage ORDER BY owner_kind, owner_id")
