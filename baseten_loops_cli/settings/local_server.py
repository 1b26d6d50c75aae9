"""Where the local server records itself in the state dir, read without importing the backend.

The server (``baseten_loops_cli.local.daemon``) writes these files; the settings layer only reads
them, so a command on the ``local`` profile learns the URL and token without importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from baseten_loops_cli.settings import paths

TOKEN_FILE = "token"
INFO_FILE = "server.json"
PID_FILE = "server.pid"
LOG_FILE = "server.log"


def state_file(name: str) -> Path:
    return paths.state_dir() / name


def read_token() -> str | None:
    try:
        return state_file(TOKEN_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def read_info() -> dict | None:
    """The last ``server.json`` the server wrote ({url, port, pid, version, started_at}), if any."""
    try:
        return json.loads(state_file(INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
