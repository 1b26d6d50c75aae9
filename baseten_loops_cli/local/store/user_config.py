"""The user's accelerator priorities (one row)."""

from __future__ import annotations

import json

from baseten_loops_cli.local.store.base import StoreBase


SCHEMA = """
CREATE TABLE IF NOT EXISTS user_config (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    trainer_accelerator_priority TEXT,
    sampler_accelerator_priority TEXT
);
"""


class UserConfigTable(StoreBase):
    def get_user_config(self) -> dict[str, list[str] | None]:
        row = self._conn().execute("SELECT * FROM user_config WHERE id = 1").fetchone()
        if row is None:
            return {"trainer_accelerator_priority": None, "sampler_accelerator_priority": None}
        return {
            key: json.loads(row[key]) if row[key] is not None else None
            for key in ("trainer_accelerator_priority", "sampler_accelerator_priority")
        }

    def set_user_config(self, values: dict[str, list[str] | None]) -> None:
        current = self.get_user_config()
        current.update(values)
        with self._tx() as db:
            db.execute(
                "INSERT INTO user_config (id, trainer_accelerator_priority,"
                " sampler_accelerator_priority) VALUES (1, ?, ?) ON CONFLICT (id) DO UPDATE"
                " SET trainer_accelerator_priority = excluded.trainer_accelerator_priority,"
                " sampler_accelerator_priority = excluded.sampler_accelerator_priority",
                tuple(json.dumps(current[k]) if current[k] is not None else None
                      for k in ("trainer_accelerator_priority", "sampler_accelerator_priority")),
            )
