"""Sessions: a client's session, the parent of its runs and samplers."""

from __future__ import annotations

import dataclasses
import time

from baseten_loops_cli.local.store.base import StoreBase, new_short_id


@dataclasses.dataclass(frozen=True)
class SessionRow:
    id: str
    team_id: str | None
    training_project_id: str | None
    created_at: float


SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    team_id TEXT,
    training_project_id TEXT,
    created_at REAL NOT NULL
);
"""


class SessionsTable(StoreBase):
    def create_session(self, team_id: str | None, training_project_id: str | None) -> SessionRow:
        now = time.time()
        sid = self._insert_with_fresh_id(
            new_short_id,
            "INSERT INTO sessions (id, team_id, training_project_id, created_at) VALUES (?,?,?,?)",
            lambda i: (i, team_id, training_project_id, now),
        )
        return self.get_session(sid)  # type: ignore[return-value]

    def get_session(self, session_id: str) -> SessionRow | None:
        return self._one(SessionRow, "SELECT * FROM sessions WHERE id = ?", (session_id,))
