"""API keys: ``BASETEN_API_KEY`` > keyring (service ``baseten-loops``, account = profile) >
a 0600 file fallback. The local profile's key is the running server's token.

keyring is imported lazily (it costs ~140 ms) and treated as unusable when its chosen backend is
the ``fail`` or ``null`` one (headless CI) or when ``LOOPS_KEYRING_DISABLED=1``; then keys go to
``credentials.toml`` (mode 0600) with a one-time warning. No function here ever logs a key.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from baseten_loops_cli.settings import paths

KEYRING_SERVICE = "baseten-loops"

_warned_fallback = False


@dataclass
class StoredKey:
    key: str | None
    source: str | None  # env | keyring | file | local-server | None

    @property
    def found(self) -> bool:
        return bool(self.key)


def keyring_disabled() -> bool:
    return os.environ.get("LOOPS_KEYRING_DISABLED", "").lower() in {"1", "true", "yes"}


def _usable_keyring():
    """Return the keyring backend if a real one is available, else None."""
    if keyring_disabled():
        return None
    try:
        import keyring
        import keyring.backends.fail
        import keyring.backends.null
    except Exception:  # keyring missing or broken: behave as if there were none
        return None
    try:
        backend = keyring.get_keyring()
    except Exception:
        return None
    if isinstance(backend, (keyring.backends.fail.Keyring, keyring.backends.null.Keyring)):
        return None
    # A chainer with no members behaves like the fail backend.
    if type(backend).__name__ == "ChainerBackend" and not getattr(backend, "backends", None):
        return None
    return backend


def _read_file() -> dict[str, str]:
    import tomllib

    path = paths.credentials_file()
    if not path.exists():
        return {}
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError):
        from baseten_loops_cli.errors import ConfigError

        # Never echo the file's content: it holds secrets.
        raise ConfigError(
            f"{path}: cannot be parsed",
            hint="Delete it and run `loops auth login` again.",
        ) from None
    keys = raw.get("keys") or {}
    return {str(k): str(v) for k, v in keys.items()}


def _write_file(keys: dict[str, str]) -> None:
    lines = ["# loops API keys (fallback store: no usable keyring). Keep this file private.", "[keys]"]
    for name in sorted(keys):
        escaped = keys[name].replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'"{name}" = "{escaped}"')
    paths.write_private_file(paths.credentials_file(), "\n".join(lines) + "\n")


def _warn_fallback_once() -> None:
    global _warned_fallback
    if _warned_fallback:
        return
    _warned_fallback = True
    reason = (
        "LOOPS_KEYRING_DISABLED is set"
        if keyring_disabled()
        else "no usable keyring backend was found"
    )
    print(
        f"Warning: {reason}; storing the key in {paths.credentials_file()} (mode 0600).",
        file=sys.stderr,
    )


def check_key(key: str, where: str) -> None:
    """Refuse a key that an HTTP header cannot carry (inner whitespace, control or non-ASCII
    characters): sent, it fails inside the HTTP library with an error quoting the header, and
    so the key. ``where`` names its source ("BASETEN_API_KEY"); the key itself is never shown."""
    from baseten_loops_cli.errors import AuthError

    if not all("!" <= ch <= "~" for ch in key):
        raise AuthError(
            f"the API key from {where} contains whitespace, a control character or a non-ASCII character",
            hint="Set it again from the exact value shown at https://app.baseten.co/settings/api_keys.",
        )


def get_key(profile: str, *, kind: str = "baseten", use_env: bool = True) -> StoredKey:
    """The key of ``profile``, surrounding whitespace removed (a secret read from a file often
    ends in a newline). :func:`check_key` says whether it can be sent."""
    stored = _get_key(profile, kind=kind, use_env=use_env)
    key = (stored.key or "").strip()
    return StoredKey(key, stored.source) if key else StoredKey(None, None)


def _get_key(profile: str, *, kind: str, use_env: bool) -> StoredKey:
    if use_env and os.environ.get("BASETEN_API_KEY", "").strip():
        return StoredKey(os.environ["BASETEN_API_KEY"], "env")
    if kind == "local":
        from baseten_loops_cli.settings.local_server import read_token

        token = read_token()
        return StoredKey(token, "local-server" if token else None)
    kr = _usable_keyring()
    if kr is not None:
        try:
            value = kr.get_password(KEYRING_SERVICE, profile)
        except Exception:
            value = None
        if value:
            return StoredKey(value, "keyring")
    value = _read_file().get(profile)
    if value:
        return StoredKey(value, "file")
    return StoredKey(None, None)


def store_key(profile: str, key: str) -> str:
    """Store ``key`` for ``profile``; return where it went ("keyring" or "file")."""
    kr = _usable_keyring()
    if kr is not None:
        try:
            kr.set_password(KEYRING_SERVICE, profile, key)
            # A stale fallback copy would shadow nothing but would linger on disk: drop it.
            keys = _read_file()
            if keys.pop(profile, None) is not None:
                _write_file(keys)
            return "keyring"
        except Exception:
            pass  # e.g. a locked or write-refusing backend: fall through to the file
    _warn_fallback_once()
    keys = _read_file()
    keys[profile] = key
    _write_file(keys)
    return "file"


def delete_key(profile: str) -> list[str]:
    """Remove the stored key for ``profile`` everywhere; return the stores it was removed from."""
    removed = []
    kr = _usable_keyring()
    if kr is not None:
        try:
            if kr.get_password(KEYRING_SERVICE, profile):
                kr.delete_password(KEYRING_SERVICE, profile)
                removed.append("keyring")
        except Exception:
            pass
    keys = _read_file()
    if keys.pop(profile, None) is not None:
        _write_file(keys)
        removed.append("file")
    return removed
