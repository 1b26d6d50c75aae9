"""What belongs to the local backend's one user (``UserAccount``): sessions and the user
config (accelerator priorities). Routes call this, never the store."""

from __future__ import annotations

from typing import Any

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.store import SessionRow
from baseten_loops_cli.local.server.errors import bad_request

__all__ = ["USER_CONFIG_KEYS", "SessionRow", "UserAccount"]

USER_CONFIG_KEYS = ("trainer_accelerator_priority", "sampler_accelerator_priority")


class UserAccount:
    def __init__(self, store: st.Store) -> None:
        self.store = store

    # ── sessions ──

    def create_session(self, team_id: str | None, training_project_id: str | None) -> SessionRow:
        return self.store.create_session(team_id, training_project_id)

    def find_session(self, session_id: str) -> SessionRow | None:
        return self.store.get_session(session_id)

    # ── user config ──

    def user_config(self) -> dict[str, list[str] | None]:
        return self.store.get_user_config()

    def update_user_config(self, values: dict[str, Any]) -> dict[str, list[str] | None]:
        """``PATCH /v1/loops/user_config``: check every field (a non-empty list of accelerator
        names, or null to leave it), store them, return the whole config."""
        unknown = sorted(set(values) - set(USER_CONFIG_KEYS))
        if unknown:
            raise bad_request(f"Unknown user_config field(s): {', '.join(unknown)}. Accepted: "
                              f"{', '.join(USER_CONFIG_KEYS)}.", "InvalidRequest")
        for key, value in values.items():
            if value is None:
                continue
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise bad_request(f"{key} must be a list of accelerator names or null.",
                                  "InvalidRequest")
            if not value:
                raise bad_request(f"{key} must not be empty; pass null to clear it.",
                                  "InvalidRequest")
        self.store.set_user_config(values)
        return self.store.get_user_config()
