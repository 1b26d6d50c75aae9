"""Turn the selected profile into a connected control-plane client.

This is the one place that knows how a profile becomes (base URL, key): commands call
``open_backend`` and never read env vars or files themselves. On the ``local`` profile the
embedded server is started when it is not running (announced on stderr), unless
``LOOPS_BASE_URL`` points elsewhere or ``LOOPS_NO_AUTOSTART=1``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from baseten_loops_cli.errors import AuthError, LoopsError
from baseten_loops_cli.settings import credentials
from baseten_loops_cli.settings.profiles import ResolvedProfile, resolve_profile

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient


@dataclass
class Backend:
    profile: ResolvedProfile
    base_url: str
    api_key: str
    key_source: str
    client: "LoopsClient"

    @property
    def profile_name(self) -> str:
        return self.profile.name

    @property
    def kind(self) -> str:
        return self.profile.kind

    def close(self) -> None:
        self.client.close()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def resolve_connection(
    profile_flag: str | None = None,
    *,
    base_url_flag: str | None = None,
    announce: Callable[[str], None] = _stderr,
    autostart: bool = True,
) -> tuple[ResolvedProfile, str, str, str]:
    """Return (profile, base_url, api_key, key_source), starting the local server if needed."""
    resolved = resolve_profile(profile_flag, base_url_flag)
    base_url = resolved.base_url
    if resolved.kind == "local" and base_url is None:
        if autostart and os.environ.get("LOOPS_NO_AUTOSTART", "") not in {"1", "true"}:
            from baseten_loops_cli.local.daemon import ensure_running

            info = ensure_running(announce=announce)
            base_url = info.url
        else:
            from baseten_loops_cli.settings.local_server import read_info

            info = read_info()
            if not info:
                raise LoopsError(
                    "the local server is not running",
                    hint="Start it with `loops server start`.",
                )
            base_url = info["url"]
    stored = credentials.get_key(resolved.name, kind=resolved.kind)
    if not stored.found:
        if resolved.kind == "local":
            raise AuthError(
                "no token for the local server",
                hint="Restart it with `loops server stop && loops server start`.",
            )
        raise AuthError(
            f"no API key for profile {resolved.name!r}",
            hint=f"Run `loops auth login --profile {resolved.name}` or export BASETEN_API_KEY.",
        )
    return resolved, base_url.rstrip("/"), stored.key, stored.source


def open_backend(
    profile_flag: str | None = None,
    *,
    base_url_flag: str | None = None,
    announce: Callable[[str], None] = _stderr,
    debug_log: Callable[[str], None] | None = None,
) -> Backend:
    resolved, base_url, key, source = resolve_connection(
        profile_flag, base_url_flag=base_url_flag, announce=announce
    )
    from baseten_loops_cli.api.client import LoopsClient

    if debug_log is None and os.environ.get("LOOPS_DEBUG", "") in {"1", "true"}:
        debug_log = _stderr
    client = LoopsClient(base_url, key, team=resolved.profile.team, debug_log=debug_log)
    return Backend(resolved, base_url, key, source, client)


def open_backend_if_reachable(profile_flag: str | None = None) -> Backend | None:
    """The backend, without starting the local server: None when it is not running."""
    try:
        resolved, base_url, key, source = resolve_connection(profile_flag, autostart=False)
    except LoopsError:
        return None
    from baseten_loops_cli.api.client import LoopsClient

    client = LoopsClient(base_url, key, team=resolved.profile.team)
    return Backend(resolved, base_url, key, source, client)
