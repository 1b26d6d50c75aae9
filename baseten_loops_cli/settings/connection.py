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
class Capabilities:
    """What a backend does beyond the shared protocol. Code asks these questions instead of
    comparing the profile's kind with "local", so a third kind of backend is one table row.

    - ``billable``: provisioning costs money: confirm before creating runs or deployments,
      and say that plans leave out provisioning time.
    - ``calibrated_plans``: this machine trains, so a plan's time estimate can be measured
      by earlier runs here (``training.calibration``).
    - ``usage_counters``: the backend reports per-run and per-sampler token counters
      (``LoopsClient.local_usage``).
    - ``deployments_under_base_url``: a deployment's OpenAI routes are served below the
      backend's own URL (``/deployments/ID/v1``), not on a model host of their own.
    - ``default_instance_type``: what a deployment runs on unless told; None: must be named.
    - ``gpu_allocations``: trainers and samplers hold GPUs, so ``loops usage`` sums GPUs; else
      it counts allocations (the local backend's CPU workers report no GPUs).
    - ``local_server``: the backend is this machine's local server: its URL is in the
      server's state file (unless the profile names one) and its key is the server's token,
      so there is nothing to log in to (``auth login`` refuses such a profile; a missing
      token means "start the server").
    """

    billable: bool
    calibrated_plans: bool
    usage_counters: bool
    deployments_under_base_url: bool
    default_instance_type: str | None
    gpu_allocations: bool
    local_server: bool


CAPABILITIES = {
    "local": Capabilities(billable=False, calibrated_plans=True, usage_counters=True,
                          deployments_under_base_url=True, default_instance_type="local-cpu",
                          gpu_allocations=False, local_server=True),
    "baseten": Capabilities(billable=True, calibrated_plans=False, usage_counters=False,
                            deployments_under_base_url=False, default_instance_type=None,
                            gpu_allocations=True, local_server=False),
}


def capabilities_of(kind: str) -> Capabilities:
    """The capabilities of a profile kind; an unknown kind is treated as a remote service."""
    return CAPABILITIES.get(kind, CAPABILITIES["baseten"])


@dataclass(frozen=True)
class Connection:
    profile: ResolvedProfile
    base_url: str
    api_key: str
    key_source: str

    @property
    def kind(self) -> str:
        """The profile's kind ("local", "baseten"): a name for messages (branch on capabilities)."""
        return self.profile.kind

    @property
    def profile_name(self) -> str:
        """The profile's name (connections and what they made are told apart by it)."""
        return self.profile.name

    @property
    def capabilities(self) -> Capabilities:
        return capabilities_of(self.profile.kind)


def needs_local_server(resolved: ResolvedProfile) -> bool:
    """Whether this profile is served by the local server at a URL only it knows."""
    return capabilities_of(resolved.kind).local_server and resolved.base_url is None


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
        if capabilities_of(resolved.kind).local_server:
            raise AuthError(
                "no token for the local server",
                hint="Restart it with `loops server stop && loops server start`.",
            )
        raise AuthError(
            f"no API key for profile {resolved.name!r}",
            hint=f"Run `loops auth login --profile {resolved.name}` or export BASETEN_API_KEY.",
        )
    assert stored.key is not None and stored.source is not None  # found: get_key names where it came from
    credentials.check_key(stored.key, key_origin(stored.source, resolved.name))
    return Connection(resolved, base_url.rstrip("/"), stored.key, stored.source)


_KEY_SOURCES = {"env": "BASETEN_API_KEY", "local-server": "the local server's token file"}


def key_origin(source: str | None, profile_name: str) -> str:
    """Where a key came from, as error messages name it ("BASETEN_API_KEY", "profile 'prod'")."""
    return _KEY_SOURCES.get(source or "", f"profile {profile_name!r}")
