"""Operations: a trainer op's record, its idempotency key, result and retention."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from typing import Any, Iterable

from baseten_loops_cli.local.store.base import (OP_DONE, OP_ERROR, OP_EXPIRED, OP_PENDING, OP_RUNNING, StoreBase)


@dataclasses.dataclass(frozen=True)
class OperationRow:
    run_id: str
    id: str
    op: str
    idempotency_key: str | None
    seq_id: int | None
    status: str
    # The result as the JSON text stored and answered: encoded once, when the op finishes,
    # and never decoded on the way to a poller.
    result_json: str | None
    error: str | None
    error_class: str | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None

    @property
    def result(self) -> Any:
        return json.loads(self.result_json) if self.result_json else None


SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    run_id TEXT NOT NULL,
    id TEXT NOT NULL,
    op TEXT NOT NULL,
    idempotency_key TEXT,
    seq_id INTEGER,
    status TEXT NOT NULL,
    result TEXT,
    error TEXT,
    error_class TEXT,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    PRIMARY KEY (run_id, id)
);
-- The janitor expires results by (status, finish time) every tick. With an index on status
-- alone SQLite reads every finished row to test finished_at, which lies behind the result
-- blob: ~30 ms per 10,000 ops of the last hour, blocking the event loop each tick. The same
-- index serves the lookups by status alone (restart recovery, listings).
DROP INDEX IF EXISTS operations_by_status;
CREATE INDEX IF NOT EXISTS operations_by_status_finish ON operations(status, finished_at);
-- The purge forgets ops by finish time alone.
CREATE INDEX IF NOT EXISTS operations_by_finish ON operations(finished_at);
"""


class OperationsTable(StoreBase):
    def insert_operation(
        self, *, run_id: str, op_id: str, op: str, idempotency_key: str | None,
        seq_id: int | None,
    ) -> OperationRow:
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO operations (run_id, id, op, idempotency_key, seq_id, status,"
                " submitted_at) VALUES (?,?,?,?,?,?,?)",
                (run_id, op_id, op, idempotency_key, seq_id, OP_PENDING, now),
            )
        return self.get_operation(run_id, op_id)  # type: ignore[return-value]

    def _operation(self, row: sqlite3.Row | None) -> OperationRow | None:
        if row is None:
            return None
        values = {k: row[k] for k in row.keys()}
        values["result_json"] = values.pop("result")
        return OperationRow(**values)

    def get_operation(self, run_id: str, op_id: str) -> OperationRow | None:
        return self._operation(self._conn().execute(
            "SELECT * FROM operations WHERE run_id = ? AND id = ?", (run_id, op_id)).fetchone())

    def list_operations(
        self, *, run_id: str | None = None, statuses: Iterable[str] | None = None,
        since: float | None = None,
    ) -> list[OperationRow]:
        clauses: list[str] = []
        args: list[str | float] = []
        if run_id is not None:
            clauses.append("run_id = ?")
            args.append(run_id)
        if statuses is not None:
            statuses = list(statuses)
            clauses.append(f"status IN ({','.join('?' * len(statuses))})")
            args.extend(statuses)
        if since is not None:
            clauses.append("submitted_at >= ?")
            args.append(since)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._conn().execute(
            f"SELECT * FROM operations {where} ORDER BY submitted_at", args).fetchall()
        return [self._operation(r) for r in rows]  # type: ignore[misc]

    def mark_operation_running(self, run_id: str, op_id: str) -> None:
        self._update_op(run_id, op_id, {"status": OP_RUNNING, "started_at": time.time()})

    def finish_operation(
        self, run_id: str, op_id: str, *, result_json: str | None = None, error: str | None = None,
        error_class: str | None = None, finished_at: float | None = None,
    ) -> None:
        """Record how an op ended: done with ``result_json`` (JSON text), or ``error``."""
        fields: dict[str, Any] = {"finished_at": finished_at or time.time()}
        if error is None:
            fields.update(status=OP_DONE, result=result_json)
        else:
            fields.update(status=OP_ERROR, error=error, error_class=error_class or "Error")
        self._update_op(run_id, op_id, fields)

    def fail_unfinished_operations(self, error: str, error_class: str) -> int:
        """Used at startup: ops that were queued or running when the server stopped can
        never finish; they answer with this error instead of hanging their pollers."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE operations SET status = ?, error = ?, error_class = ?, finished_at = ?"
                " WHERE status IN (?, ?)",
                (OP_ERROR, error, error_class, time.time(), OP_PENDING, OP_RUNNING),
            )
            return cur.rowcount

    def fail_pending_operations_of_run(self, run_id: str, error: str,
                                       error_class: str) -> list[str]:
        with self._tx() as db:
            ids = [r[0] for r in db.execute(
                "SELECT id FROM operations WHERE run_id = ? AND status = ?",
                (run_id, OP_PENDING)).fetchall()]
            db.execute(
                "UPDATE operations SET status = ?, error = ?, error_class = ?, finished_at = ?"
                " WHERE run_id = ? AND status = ?",
                (OP_ERROR, error, error_class, time.time(), run_id, OP_PENDING),
            )
        return ids

    def expire_operation_results(self, finished_before: float) -> int:
        """Drop results older than the retention window (their polls then answer 404)."""
        with self._tx() as db:
            return db.execute(
                "UPDATE operations SET status = ?, result = NULL WHERE status IN (?, ?)"
                " AND finished_at < ?",
                (OP_EXPIRED, OP_DONE, OP_ERROR, finished_before)).rowcount

    def purge_operations(self, finished_before: float) -> int:
        """Forget ops entirely once the idempotency window is over."""
        with self._tx() as db:
            return db.execute(
                "DELETE FROM operations WHERE finished_at IS NOT NULL AND finished_at < ?",
                (finished_before,)).rowcount

    def _update_op(self, run_id: str, op_id: str, fields: dict[str, Any]) -> None:
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(f"UPDATE operations SET {cols} WHERE run_id = ? AND id = ?",
                       (*fields.values(), run_id, op_id))
