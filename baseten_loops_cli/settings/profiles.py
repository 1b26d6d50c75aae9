"""Profiles: named backends in ``config.toml``, and the precedence rules that pick one.

File format (``$LOOPS_CONFIG_DIR/config.toml``)::

    active = "prod"

    [profiles.local]
    kind = "local"

    [profiles.prod]
    kind = "baseten"
    base_url = "https://api.baseten.co"

Precedence for every setting: flag > environment variable > selected profile > default.
The profile itself is chosen by ``--profile`` > ``LOOPS_PROFILE`` > ``active`` > the default:
``local`` -- unless there is no config file at all and ``BASETEN_API_KEY`` is exported without
``LOOPS_BASE_URL``, in which case the user clearly means Baseten and the implicit ``baseten``
profile is used.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from baseten_loops_cli.errors import ConfigError, UsageError
from baseten_loops_cli.settings import paths

BASETEN_DEFAULT_URL = "https://api.baseten.co"
PROFILE_KINDS = ("local", "baseten")
PROFILE_KEYS = {"kind", "base_url", "team", "output"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class Profile:
    name: str
    kind: str = "local"
    base_url: str | None = None
    team: str | None = None
    output: str | None = None

    def to_dict(self) -> dict[str, str]:
        data = {"kind": self.kind}
        for key in ("base_url", "team", "output"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value
        return data


@dataclass
class ConfigFile:
    """The parsed ``config.toml``; ``exists`` is False when no file has been written yet."""

    path: Path
    active: str | None = None
    profiles: dict[str, Profile] = field(default_factory=dict)
    exists: bool = False

    @classmethod
    def load(cls, path: Path | None = None) -> "ConfigFile":
        import tomllib

        path = path or paths.config_file()
        if not path.exists():
            return cls(path=path, profiles=_builtin_profiles())
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            # tomllib says "... (at line 3, column 7)": keep that, it names the place.
            raise ConfigError(
                f"{path}: not valid TOML: {exc}",
                hint="Fix the file by hand, or move it away and run `loops config use local`.",
            ) from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        profiles = _builtin_profiles()
        for name, body in (raw.get("profiles") or {}).items():
            if not isinstance(body, dict):
                raise ConfigError(f"{path}: [profiles.{name}] must be a table")
            unknown = set(body) - PROFILE_KEYS
            if unknown:
                raise ConfigError(
                    f"{path}: [profiles.{name}] has unknown key {sorted(unknown)[0]!r}",
                    hint=f"Valid keys: {', '.join(sorted(PROFILE_KEYS))}.",
                )
            kind = body.get("kind", "baseten" if name != "local" else "local")
            if kind not in PROFILE_KINDS:
                raise ConfigError(
                    f"{path}: [profiles.{name}] kind = {kind!r} is not one of {', '.join(PROFILE_KINDS)}"
                )
            profiles[name] = Profile(
                name=name,
                kind=kind,
                base_url=body.get("base_url"),
                team=body.get("team"),
                output=body.get("output"),
            )
        active = raw.get("active")
        if active is not None and not isinstance(active, str):
            raise ConfigError(f"{path}: 'active' must be a profile name string")
        return cls(path=path, active=active, profiles=profiles, exists=True)

    def save(self) -> None:
        lines = []
        if self.active:
            lines.append(f"active = {_toml_str(self.active)}")
            lines.append("")
        for name in sorted(self.profiles):
            profile = self.profiles[name]
            lines.append(f"[profiles.{_toml_key(name)}]")
            for key, value in profile.to_dict().items():
                lines.append(f"{key} = {_toml_str(value)}")
            lines.append("")
        paths.write_private_file(self.path, "\n".join(lines))
        self.exists = True

    def get(self, name: str) -> Profile:
        try:
            return self.profiles[name]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(name, list(self.profiles), n=1)
            suggestion = f" Did you mean {close[0]!r}?" if close else ""
            raise UsageError(
                f"unknown profile {name!r}.{suggestion}",
                hint=f"Known profiles: {', '.join(sorted(self.profiles))}. "
                "Create one with `loops auth login --profile NAME`.",
            ) from None


def _builtin_profiles() -> dict[str, Profile]:
    return {
        "local": Profile(name="local", kind="local"),
        "baseten": Profile(name="baseten", kind="baseten"),
    }


def validate_profile_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise UsageError(
            f"invalid profile name {name!r}",
            hint="Use letters, digits, '.', '_' or '-' (at most 64 characters).",
        )
    return name


def _toml_str(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _toml_key(name: str) -> str:
    return name if re.match(r"^[A-Za-z0-9_-]+$", name) else _toml_str(name)


@dataclass
class ResolvedProfile:
    """A profile with every setting resolved, and where each came from (for ``config list``)."""

    profile: Profile
    profile_source: str  # flag | env | active | default
    base_url: str | None
    base_url_source: str  # flag | env | profile | default | local-server

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def kind(self) -> str:
        return self.profile.kind


def select_profile_name(flag: str | None, config: ConfigFile) -> tuple[str, str]:
    """Return (profile name, source) by the precedence flag > env > active > default."""
    if flag:
        return flag, "flag"
    env = os.environ.get("LOOPS_PROFILE")
    if env:
        return env, "env"
    if config.active:
        return config.active, "active"
    if (
        not config.exists
        and os.environ.get("BASETEN_API_KEY")
        and not os.environ.get("LOOPS_BASE_URL")
    ):
        return "baseten", "default"
    return "local", "default"


def resolve_profile(
    profile_flag: str | None = None,
    base_url_flag: str | None = None,
    config: ConfigFile | None = None,
) -> ResolvedProfile:
    config = config or ConfigFile.load()
    name, source = select_profile_name(profile_flag, config)
    profile = config.get(name)
    if base_url_flag:
        base_url, url_source = base_url_flag, "flag"
    elif os.environ.get("LOOPS_BASE_URL"):
        base_url, url_source = os.environ["LOOPS_BASE_URL"], "env"
    elif profile.base_url:
        base_url, url_source = profile.base_url, "profile"
    elif profile.kind == "baseten":
        base_url, url_source = BASETEN_DEFAULT_URL, "default"
    else:
        # The local server picks its port when it starts; the URL is read from its state file.
        base_url, url_source = None, "local-server"
    return ResolvedProfile(profile, source, base_url.rstrip("/") if base_url else None, url_source)
