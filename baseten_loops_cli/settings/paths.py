"""Where loops keeps things on disk.

Each directory has an override environment variable so tests (and users with unusual setups)
can relocate it; otherwise platformdirs decides, with appname ``baseten-loops``.

- config (profiles TOML, the 0600 credentials fallback): ``LOOPS_CONFIG_DIR``
- state (the local server's pid file, log, token and url): ``LOOPS_STATE_DIR``
- data (the local server's SQLite database and checkpoints): ``LOOPS_DATA_DIR``
- cache (completion cache, converted models): ``LOOPS_CACHE_DIR``
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "baseten-loops"


def _dir(env: str, kind: str) -> Path:
    override = os.environ.get(env)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(getattr(platformdirs, f"user_{kind}_dir")(APP_NAME, appauthor=False))


def config_dir() -> Path:
    return _dir("LOOPS_CONFIG_DIR", "config")


def state_dir() -> Path:
    return _dir("LOOPS_STATE_DIR", "state")


def data_dir() -> Path:
    return _dir("LOOPS_DATA_DIR", "data")


def cache_dir() -> Path:
    return _dir("LOOPS_CACHE_DIR", "cache")


def config_file() -> Path:
    return config_dir() / "config.toml"


def credentials_file() -> Path:
    return config_dir() / "credentials.toml"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (0700) if needed and return it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def write_private_file(path: Path, text: str) -> None:
    """Write ``text`` atomically to ``path`` with mode 0600 (never briefly world-readable)."""
    ensure_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
