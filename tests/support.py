"""Helpers shared by the tests (not fixtures: conftest.py owns those).

- :func:`cli_env`: the one environment of a ``loops`` run against a test server (a child
  process, or in process through ``cli_support.loops``).
- :func:`wait_for`: the one wait on a condition (never a fixed sleep followed by an assumption).
- :func:`kill`: SIGKILL a process (a server, a ``loops`` child and its process group) and wait
  until it is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

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


# ── the environment of a `loops` run ─────────────────────────────────────────────────────

def ctrl_c_as_a_terminal_sends() -> None:
    """``preexec_fn`` of a child a test interrupts with SIGINT: the default disposition, so
    Python turns it into KeyboardInterrupt. A pytest started in the background (``cmd &`` in a
    non-interactive shell, as a CI script may) has SIGINT ignored, every child inherits that,
    and a `loops` relying on KeyboardInterrupt (downloads, --tail) would not see Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Variables of the developer's shell that would change what a `loops` under test does.
FOREIGN_PREFIXES = ("LOOPS_", "BASETEN_", "_LOOPS_", "WANDB_")


def cli_env(server: Any = None, **overrides: str | None) -> dict[str, str]:
    """The environment of a ``loops`` run: this process's, minus every ``LOOPS_*``,
    ``BASETEN_*``, ``_LOOPS_*`` and ``WANDB_*`` variable; then ``server.env`` (its four
    ``LOOPS_*_DIR``, URL and key) when a server is given; no autostart, no colour, a dumb
    200-column terminal, this checkout on PYTHONPATH (a child imports the code under test),
    and the Hugging Face hub offline (loopback only: a bad model name never reaches it); then
    ``overrides`` (``None`` removes a variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_PREFIXES)}
    if server is not None:
        env.update(server.env)
    env.update(LOOPS_NO_AUTOSTART="1", NO_COLOR="1", TERM="dumb", COLUMNS="200", PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


# ── waiting and killing ──────────────────────────────────────────────────────────────────


def pull_events(client: Any, model: str) -> list[dict]:
    """``POST /v1/local/models/pull`` of ``model`` through ``client`` (an httpx.Client on a
    server): the NDJSON events its stream carried, after checking it is one."""
    import json

    with client.stream("POST", "/v1/local/models/pull", json={"model": model}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(
            "application/x-ndjson")
        return [json.loads(line) for line in resp.iter_lines() if line.strip()]


def wait_for(condition: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.2, what: str | None = None) -> T:
    """Ask ``condition`` every ``interval`` seconds until it returns something truthy (which is
    returned); after ``timeout`` seconds fail, naming ``what`` and the last answer. The polling
    is the product's one helper (``api.polling.Poll``, tested on its own)."""
    from baseten_loops_cli.api.polling import Poll

    value = None
    for _ in Poll(interval=interval, timeout=timeout):
        value = condition()
        if value:
            return value
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what or condition}; last answer: {value!r}")


def kill(process: Any, *, group: bool = False, timeout: float = 30.0) -> tuple[Any, Any] | None:
    """SIGKILL ``process`` and wait until it is gone: no handler runs, nothing more gets written.

    ``process``: a :class:`subprocess.Popen` (``group=True`` kills its whole process group, as
    for a ``loops`` started with ``start_new_session``; returns what it wrote, as
    ``communicate()``), a pid, or anything with a ``pid`` (a test server: reaped when it is our
    child)."""
    pid = process if isinstance(process, int) else process.pid
    try:
        os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if isinstance(process, subprocess.Popen):
        return process.communicate(timeout=timeout)

    def gone() -> bool:
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout=timeout, interval=0.05, what=f"process {pid} to die")
    return None


@contextlib.contextmanager
def serve_asgi(app: Any) -> Iterator[str]:
    """An ASGI app served by uvicorn on a free 127.0.0.1 port in a thread (a real HTTP peer for
    judges, teachers and endpoints the tests stand up); yields its base URL and stops it after."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=20, interval=0.05, what="the test's HTTP server to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
