"""Resolve the selected profile to (base URL, key), reading only: env vars, the profiles
file, the credential store and, on the ``local`` profile, the ``server.json`` the running
local server wrote. Starting that server and building clients is the caller's job
(``cli/_backend.py``, the one place that composes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from baseten_loops_cli.errors import AuthError, LoopsError
from baseten_loops_cli.settings import credentials
from baseten_loops_cli.settings.local_server import read_info
from baseten_loops_cli.settings.profiles import ResolvedProfile, resolve_profile


@dataclass(frozen=True)
class Connection:
    profile: ResolvedProfile
    base_url: str
    api_key: str
    key_source: str


def needs_local_server(resolved: ResolvedProfile) -> bool:
    """Whether this profile is served by the local server at a URL only it knows."""
    return resolved.kind == "local" and resolved.base_url is None


def resolve_connection(profile_flag: str | None = None, *,
                       base_url_flag: str | None = None) -> Connection:
    """The URL and key of ``profile_flag`` (default: the selected profile). On the local
    profile, LoopsError when the local server is not running."""
    resolved = resolve_profile(profile_flag, base_url_flag)
    base_url = resolved.base_url
    if needs_local_server(resolved):
        info = read_info()
        if not info:
            raise LoopsError("the local server is not running",
                             hint="Start it with `loops server start`.")
        base_url = info["url"]
    assert base_url is not None
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
    credentials.check_key(stored.key, key_origin(stored.source, resolved.name))
    return Connection(resolved, base_url.rstrip("/"), stored.key, stored.source)


_KEY_SOURCES = {"env": "BASETEN_API_KEY", "local-server": "the local server's token file"}


def key_origin(source: str | None, profile_name: str) -> str:
    """Where a key came from, as error messages name it ("BASETEN_API_KEY", "profile 'prod'")."""
    return _KEY_SOURCES.get(source or "", f"profile {profile_name!r}")
