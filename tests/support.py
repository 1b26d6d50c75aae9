"""Helpers shared by the foundation tests (not fixtures: conftest.py owns those)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LOOPS_ENV_VARS = (
    "LOOPS_PROFILE",
    "LOOPS_BASE_URL",
    "BASETEN_API_KEY",
    "LOOPS_KEYRING_DISABLED",
    "LOOPS_DEBUG",
    "LOOPS_OUTPUT",
    "NO_COLOR",
)


def isolate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point every loops directory at ``tmp_path`` and clear loops env vars."""
    for var in LOOPS_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        path = tmp_path / name.lower()
        monkeypatch.setenv(f"LOOPS_{name}_DIR", str(path))
    monkeypatch.setenv("LOOPS_NO_AUTOSTART", "1")
    return tmp_path


class MemoryKeyring:
    """An in-memory keyring backend (priority > 0, so keyring treats it as usable)."""

    priority = 10

    def __init__(self) -> None:
        self.store: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, user: str) -> str | None:
        return self.store.get((service, user))

    def set_password(self, service: str, user: str, password: str) -> None:
        self.store[(service, user)] = password

    def delete_password(self, service: str, user: str) -> None:
        self.store.pop((service, user), None)


def make_memory_keyring():
    import keyring.backend

    class _Backend(MemoryKeyring, keyring.backend.KeyringBackend):
        priority = 10

        def __init__(self) -> None:
            keyring.backend.KeyringBackend.__init__(self)
            MemoryKeyring.__init__(self)

    return _Backend()


def file_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777
