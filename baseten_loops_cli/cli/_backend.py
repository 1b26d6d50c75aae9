"""The one place where a command's backend is composed: the profile's connection
(``settings.connection``), the local server started when that profile needs it (announced
on stderr; not with ``LOOPS_NO_AUTOSTART=1`` or when ``LOOPS_BASE_URL`` points elsewhere),
and the control-plane client. Commands get it from ``AppState.backend()``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from baseten_loops_cli.settings.connection import (
    Connection,
    needs_local_server,
    resolve_connection,
)

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient


@dataclass(frozen=True)
class Backend(Connection):
    """A connection and the control-plane client on it (what services take as ``Connected``)."""

    client: "LoopsClient"

    def close(self) -> None:
        self.client.close()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _debug() -> bool:
    return os.environ.get("LOOPS_DEBUG", "") in {"1", "true"}


def ensure_local_server(announce: Callable[[str], None] = _stderr) -> str:
    """The local server's URL, starting it (and saying so) unless it runs; with
    LOOPS_NO_AUTOSTART=1 a server that is not running is an error."""
    from baseten_loops_cli.local.daemon import ensure_running

    return ensure_running(announce=announce).url


def local_server_connection(announce: Callable[[str], None] = _stderr) -> tuple[str, str]:
    """The local server's (URL, token), whatever the profile; started when needed."""
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.settings.local_server import read_token

    url = ensure_local_server(announce)
    token = read_token()
    if token is None:
        raise LoopsError("the local server wrote no token",
                         hint="Restart it with `loops server stop && loops server start`.")
    return url, token


def connect(profile_flag: str | None = None, *, base_url_flag: str | None = None,
            announce: Callable[[str], None] = _stderr) -> Connection:
    """The profile's connection, starting the local server first when it needs one."""
    from baseten_loops_cli.settings.profiles import resolve_profile

    if os.environ.get("LOOPS_NO_AUTOSTART", "") not in {"1", "true"}:
        if needs_local_server(resolve_profile(profile_flag, base_url_flag)):
            ensure_local_server(announce)
    return resolve_connection(profile_flag, base_url_flag=base_url_flag)


def open_client(base_url: str, api_key: str, *, team: str | None = None,
                debug_log: Callable[[str], None] | None = None) -> "LoopsClient":
    """The control-plane client every command uses (LOOPS_DEBUG logs requests, keys redacted)."""
    from baseten_loops_cli.api.client import LoopsClient

    if debug_log is None and _debug():
        debug_log = _stderr
    return LoopsClient(base_url, api_key, team=team, debug_log=debug_log)


def open_backend(profile_flag: str | None = None, *, base_url_flag: str | None = None,
                 announce: Callable[[str], None] = _stderr,
                 debug_log: Callable[[str], None] | None = None) -> Backend:
    return _backend_on(connect(profile_flag, base_url_flag=base_url_flag, announce=announce), debug_log)


def open_backend_if_reachable(profile_flag: str | None = None) -> Backend | None:
    """The backend, without starting the local server: None when it is not running."""
    from baseten_loops_cli.errors import LoopsError

    try:
        connection = resolve_connection(profile_flag)
    except LoopsError:
        return None
    return _backend_on(connection)


def _backend_on(connection: Connection, debug_log: Callable[[str], None] | None = None) -> Backend:
    client = open_client(connection.base_url, connection.api_key, team=connection.profile.profile.team,
                         debug_log=debug_log)  # fmt: skip
    return Backend(**vars(connection), client=client)
