"""Deployment logs (what `loops runs logs` reads)."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from baseten_loops_cli.local.store.base import StoreBase


@dataclasses.dataclass(frozen=True)
class LogRow:
    id: int
    deployment_id: str
    ts_ns: int
    level: str
    message: str
    request_id: str | None


SCHEMA = """
CREATE TABLE IF NOT EXISTS logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    deployment_id TEXT NOT NULL,
    ts_ns INTEGER NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    request_id TEXT
);
CREATE INDEX IF NOT EXISTS logs_by_deployment ON logs(deployment_id, ts_ns);
"""


class LogsTable(StoreBase):
    def append_log(self, deployment_id: str, message: str, *, level: str = "INFO",
                   request_id: str | None = None, ts_ns: int | None = None) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO logs (deployment_id, ts_ns, level, message, request_id)"
                " VALUES (?,?,?,?,?)",
                (deployment_id, ts_ns or time.time_ns(), level, message, request_id),
            )

    def query_logs(
        self, deployment_id: str, *, start_ns: int, end_ns: int, levels: Iterable[str],
        descending: bool, limit: int,
    ) -> list[LogRow]:
        levels = list(levels)
        order = "DESC" if descending else "ASC"
        return self._all(
            LogRow,
            f"SELECT * FROM logs WHERE deployment_id = ? AND ts_ns >= ? AND ts_ns <= ?"
            f" AND level IN ({','.join('?' * len(levels))})"
            f" ORDER BY ts_ns {order}, id {order} LIMIT ?",
            (deployment_id, start_ns, end_ns, *levels, limit),
        )
