"""Start, stop and inspect the background local server.

The server is a detached process (``python -m baseten_loops_cli.local.server
--foreground ...``) bound to 127.0.0.1 only. It records itself in the state dir:

    server.json   {url, port, pid, version, started_at}   (written once it is listening)
    server.pid    its pid
    server.log    its stdout/stderr
    token         the API key clients must send (random, 0600, kept across restarts)
    server.lock   held (flock) for the server's lifetime: one server per state dir
    backend.json  {id, port}: its stable identity and last port (kept across restarts)

Importing this module is cheap (no torch, no starlette); httpx is imported only by the
calls that talk to the server.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from baseten_loops_cli import __version__
from baseten_loops_cli.api.polling import Poll
from baseten_loops_cli.errors import ExitCode, LoopsError
from baseten_loops_cli.settings import paths
from baseten_loops_cli.settings.local_server import INFO_FILE, LOG_FILE, PID_FILE, TOKEN_FILE

LOCK_FILE = "server.lock"
# The server's identity and last port, kept across restarts (server.json goes with the process):
# {"id": "<hex>", "port": N}. Clients key what they record about this backend (`loops deploy`'s
# deployments) by the id, not by a URL whose port may change.
BACKEND_FILE = "backend.json"
HOST = "127.0.0.1"
DEFAULT_PORT = 8717
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 90.0  # a clean stop saves every loaded trainer first


class ServerError(LoopsError):
    """The local server could not be started, stopped or reached."""


@dataclass
class ServerInfo:
    url: str
    port: int
    pid: int
    version: str
    started_at: str
    uptime_s: float | None = None
    healthy: bool = False
    models: list[dict[str, Any]] = field(default_factory=list)
    runs_in_memory: list[str] = field(default_factory=list)
    # The compute policy: requested_dtype/device, and dtype/device once the engine loaded.
    compute: dict[str, Any] = field(default_factory=dict)
    state_dir: str = ""
    data_dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ── files in the state dir ──

def _state(name: str, state_dir: Path | None = None) -> Path:
    return (state_dir or paths.state_dir()) / name


def read_token(state_dir: Path | None = None) -> str | None:
    try:
        return _state(TOKEN_FILE, state_dir).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def ensure_token(state_dir: Path | None = None) -> str:
    """The server's API key, created on first use (0600). It survives restarts so that
    exported ``BASETEN_API_KEY`` values and saved profiles keep working."""
    token = read_token(state_dir)
    if token is None:
        token = secrets.token_urlsafe(32)
        paths.write_private_file(_state(TOKEN_FILE, state_dir), token + "\n")
    return token


def read_backend(state_dir: Path | None = None) -> dict[str, Any]:
    """``backend.json`` ({id, port}; {} before the first start or if unreadable)."""
    try:
        data = json.loads(_state(BACKEND_FILE, state_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remember_backend(port: int, state_dir: Path | None = None) -> str:
    """The backend's stable id (created on the first start), recorded with the port it now
    listens on, which the next ``start`` without a port takes again when it is free."""
    backend_id = read_backend(state_dir).get("id")
    if not isinstance(backend_id, str) or not backend_id:
        backend_id = secrets.token_hex(8)
    paths.write_private_file(_state(BACKEND_FILE, state_dir),
                             json.dumps({"id": backend_id, "port": port}) + "\n")
    return backend_id


def _read_info(state_dir: Path | None = None) -> dict[str, Any] | None:
    try:
        return json.loads(_state(INFO_FILE, state_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process. A server this process started and that has
    died stays a zombie until reaped; it is reaped here and counts as dead."""
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return not _is_zombie(pid)


def _clear_records(state_dir: Path | None = None) -> None:
    for name in (INFO_FILE, PID_FILE):
        with contextlib.suppress(FileNotFoundError):
            _state(name, state_dir).unlink()


# ── status ──

def _live_record(state_dir: Path | None) -> tuple[dict, int] | None:
    """The server record and its pid while that process lives; a stale record (dead pid) is
    cleared and gives None."""
    info = _read_info(state_dir)
    if info is None:
        return None
    pid = int(info.get("pid", 0))
    if not pid or not _pid_alive(pid):
        _clear_records(state_dir)
        return None
    return info, pid


def status(state_dir: Path | None = None, *, timeout: float = 3.0) -> ServerInfo | None:
    """The running server, or None. Stale records (dead pid) are cleaned up."""
    live = _live_record(state_dir)
    if live is None:
        return None
    info, pid = live
    server = ServerInfo(url=info["url"], port=int(info["port"]), pid=pid,
                        version=info.get("version", "?"), started_at=info.get("started_at", ""),
                        state_dir=str(state_dir or paths.state_dir()),
                        data_dir=info.get("data_dir", ""))
    import httpx

    token = read_token(state_dir)
    try:
        resp = httpx.get(f"{server.url}/v1/local/status", timeout=timeout,
                         headers={"Authorization": f"Api-Key {token}"} if token else {})
        if resp.status_code == 200:
            body = resp.json()
            server.healthy = True
            server.uptime_s = body.get("uptime_s")
            server.models = body.get("models", [])
            server.runs_in_memory = body.get("runs_in_memory", [])
            server.compute = body.get("compute") or {}
    except httpx.HTTPError:
        pass
    return server


def _wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None,
                  log_path: Path | None = None) -> None:
    import httpx

    for _ in Poll(interval=0.1, timeout=timeout):
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"The local server exited during startup (code {proc.returncode}).",
                              hint=_log_hint(log_path))
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
    raise ServerError(f"The local server at {url} did not answer /health within {timeout:.0f}s.",
                      hint=_log_hint(log_path))


def _log_hint(log_path: Path | None) -> str:
    where = log_path or _state(LOG_FILE)
    return f"See {where} (`loops server logs`)."


# ── start / stop ──

def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def listen(port: int) -> socket.socket:
    """The server's listening socket: loopback only, never 0.0.0.0 (``port`` 0: any free one)."""
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off only on sockets that
    # say they are TCP, and accepted sockets inherit the listener's protocol. With Nagle on, a
    # response's body waited for the client's delayed ACK of its headers: every request on a
    # kept-alive connection took 44 ms, whatever the server did.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((HOST, port))
    except OSError as exc:
        sock.close()
        raise ServerError(f"Cannot listen on {HOST}:{port}: {exc.strerror}.") from None
    sock.listen(2048)
    return sock


def start(
    port: int | None = None,
    wait: bool = True,
    *,
    state_dir: Path | None = None,
    data_dir: Path | None = None,
    options: dict[str, Any] | None = None,
    enable_fault_hooks: bool = False,
    timeout: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
    owner_pid: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> ServerInfo:
    """Start the server in the background (no-op if one is running) and return it.

    ``port=None`` uses the port of the previous start when free (a restarted server keeps
    its URL: deployments answer where they did), else :data:`DEFAULT_PORT` when free, else
    any free port. With ``wait``
    this returns once ``/health`` answers; ``options`` override server settings
    (``ServerConfig`` fields, e.g. ``{"op_poll_hold_s": 2}``). With ``owner_pid`` the
    server stops itself when that process exits (test fixtures: no orphaned servers).
    ``dtype`` / ``device``: the compute policy (``local/engine/precision.py``; None: the
    server's default, LOOPS_DTYPE / LOOPS_DEVICE or auto). ``device="cuda"`` is checked here,
    before anything starts, so a machine without CUDA gets a one-line error.
    """
    state_dir = state_dir or paths.state_dir()
    data_dir = data_dir or paths.data_dir()
    running = status(state_dir)
    if running is not None:
        return running
    options = dict(options or {})
    if dtype is not None:
        options["dtype"] = dtype
    if device is not None:
        options["device"] = device
    # The child reads LOOPS_DTYPE / LOOPS_DEVICE when no option is given: check those too.
    check_compute(options.get("dtype") or os.environ.get("LOOPS_DTYPE") or None,
                  options.get("device") or os.environ.get("LOOPS_DEVICE") or None)
    check_checkpointing(options.get("activation_checkpointing")
                        or os.environ.get("LOOPS_ACTIVATION_CHECKPOINTING") or None)
    paths.ensure_private_dir(state_dir)
    ensure_token(state_dir)
    port = _choose_port(port, state_dir)
    cmd = [sys.executable, "-m", "baseten_loops_cli.local.server", "--foreground",
           "--port", str(port), "--data-dir", str(data_dir), "--state-dir", str(state_dir),
           *(["--enable-fault-hooks"] if enable_fault_hooks else []),
           *(["--owner-pid", str(owner_pid)] if owner_pid is not None else []),
           *(arg for key, value in options.items()
             for arg in ("--option", f"{key}={json.dumps(value)}"))]
    log_path = _state(LOG_FILE, state_dir)
    child_env = {**os.environ, **(env or {})}
    # The child must import this very package, even when it is not installed (a source
    # checkout run from another directory).
    package_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, child_env.get("PYTHONPATH", "")) if p)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the CLI exiting and its terminal's Ctrl-C
            close_fds=True, env=child_env,
        )
    poll = Poll(interval=0.05, timeout=timeout)
    for _ in poll:
        info = _read_info(state_dir)
        if info is not None and info.get("pid") == proc.pid:
            break
        if proc.poll() is not None:
            raise ServerError(f"The local server exited during startup (code {proc.returncode}).",
                              hint=_log_hint(log_path))
    else:
        proc.kill()
        raise ServerError(f"The local server did not start within {timeout:.0f}s.",
                          hint=_log_hint(log_path))
    if wait:
        _wait_healthy(info["url"], max(poll.remaining(), 1.0), proc, log_path)
    return status(state_dir) or ServerInfo(
        url=info["url"], port=info["port"], pid=proc.pid, version=info["version"],
        started_at=info["started_at"], state_dir=str(state_dir), data_dir=str(data_dir))


def _choose_port(port: int | None, state_dir: Path) -> int:
    """``port`` when free (a ServerError if not); for None the previous start's port when
    free, else :data:`DEFAULT_PORT` when free, else 0 (any free port)."""
    if port is None:
        last = read_backend(state_dir).get("port")
        if isinstance(last, int) and 0 < last < 65536 and port_free(last):
            return last
        return DEFAULT_PORT if port_free(DEFAULT_PORT) else 0
    if not port_free(port):
        raise ServerError(f"Port {port} on {HOST} is already in use.",
                          hint="Pick another with --port, or omit it to choose a free one.")
    return port


def check_checkpointing(mode: str | None) -> None:
    """A ServerError (one line, usage exit) for an activation_checkpointing mode the trainer
    does not have, before the server is spawned."""
    from baseten_loops_cli.memory_estimate import CHECKPOINTING_MODES

    if mode is not None and mode not in CHECKPOINTING_MODES:
        raise ServerError(f"Unknown activation_checkpointing mode {mode!r} "
                          "(LOOPS_ACTIVATION_CHECKPOINTING or the server option).",
                          hint=f"Use one of: {', '.join(CHECKPOINTING_MODES)}.",
                          exit_code=ExitCode.USAGE)


def check_compute(dtype: str | None, device: str | None) -> None:
    """A ServerError (one line, exit 1) for a policy this machine cannot run. Only an
    explicit CUDA request is checked here (it imports torch, seconds); ``auto`` and ``cpu``
    always run."""
    from baseten_loops_cli.local.engine import precision

    if dtype is not None and dtype not in precision.DTYPES:
        raise ServerError(f"Unknown dtype {dtype!r}.", hint=f"Use one of: {', '.join(precision.DTYPES)}.",
                          exit_code=ExitCode.USAGE)
    if device is not None and device not in precision.DEVICES:
        raise ServerError(f"Unknown device {device!r}.",
                          hint=f"Use one of: {', '.join(precision.DEVICES)}.", exit_code=ExitCode.USAGE)
    if device == "cuda":
        try:
            precision.resolve(dtype or "auto", device)
        except precision.PrecisionUnavailable as exc:
            raise ServerError(str(exc), hint="Start it with --device cpu (or auto) on this "
                              "machine.") from None


def stop(state_dir: Path | None = None, *, timeout: float = STOP_TIMEOUT_S) -> bool:
    """Stop the server (SIGTERM, then SIGKILL after ``timeout``). False if none ran."""
    live = _live_record(state_dir)
    if live is None:
        return False
    _info, pid = live
    os.kill(pid, signal.SIGTERM)
    for _ in Poll(interval=0.1, timeout=timeout):
        if not _pid_alive(pid):
            break
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _clear_records(state_dir)
    return True


def _is_zombie(pid: int) -> bool:
    """A dead process not yet reaped by its parent. Only once its last thread has exited:
    a killed process's main thread turns zombie first, while the others (and the sockets
    they share, such as the listening one) are still being torn down."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (OSError, IndexError):
        return False


def ensure_running(announce: Callable[[str], None], *, state_dir: Path | None = None,
                   port: int | None = None) -> ServerInfo:
    """For the CLI's local profile: the running server, starting one (and saying so) if needed."""
    running = status(state_dir)
    if running is not None:
        if not running.healthy:
            _wait_healthy(running.url, START_TIMEOUT_S)
        return running
    if os.environ.get("LOOPS_NO_AUTOSTART") == "1":
        raise ServerError("The local loops server is not running (LOOPS_NO_AUTOSTART=1).",
                          hint="Start it with `loops server start`.")
    announce("Starting the local loops server (first use; `loops server stop` stops it)...")
    info = start(port, wait=True, state_dir=state_dir)
    announce(f"Local loops server running at {info.url}.")
    return info


def env_lines(state_dir: Path | None = None) -> list[str]:
    """Shell lines that point the official SDK (and this CLI) at the local server."""
    info = status(state_dir)
    if info is None:
        raise ServerError("The local loops server is not running.",
                          hint="Start it with `loops server start`.")
    token = read_token(state_dir)
    return [f"export LOOPS_BASE_URL={info.url}", f"export BASETEN_API_KEY={token}"]


# ── the foreground server (what the detached process runs) ──


def _stop_when_gone(owner_pid: int, interval_s: float = 1.0) -> None:
    """Shut this server down cleanly (SIGTERM to itself) once ``owner_pid`` has exited."""
    import threading

    def watch() -> None:
        for _ in Poll(interval=interval_s):
            if not _pid_alive(owner_pid):
                break
        print(f"owner process {owner_pid} exited; shutting down", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="loops-owner-watch", daemon=True).start()

@contextlib.contextmanager
def _exclusive(state_dir: Path) -> Iterator[None]:
    paths.ensure_private_dir(state_dir)
    fd = os.open(_state(LOCK_FILE, state_dir), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_info(state_dir) or {}
            raise ServerError(f"Another local loops server is using {state_dir} "
                              f"(pid {info.get('pid', '?')}, {info.get('url', '?')}).",
                              hint="Stop it with `loops server stop`.") from None
        yield
    finally:
        os.close(fd)


def run_foreground(
    *,
    port: int,
    state_dir: Path,
    data_dir: Path,
    enable_fault_hooks: bool = False,
    options: dict[str, Any] | None = None,
    log_level: str = "info",
    owner_pid: int | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or until ``owner_pid`` exits). Writes server.json once
    listening; removes it on exit."""
    import logging

    import uvicorn

    from baseten_loops_cli.local.server import access_log
    from baseten_loops_cli.local.server.app import create_app

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with _exclusive(state_dir):
        token = ensure_token(state_dir)
        sock = listen(port)
        bound_port = sock.getsockname()[1]
        url = f"http://{HOST}:{bound_port}"
        backend_id = remember_backend(bound_port, state_dir)
        app = create_app(data_dir, token, enable_fault_hooks=enable_fault_hooks,
                         backend_id=backend_id, **(options or {}))
        config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=3, timeout_keep_alive=75)
        access_log.install()  # after uvicorn.Config, which (re)configures its loggers
        server = uvicorn.Server(config)
        started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = {"url": url, "port": bound_port, "pid": os.getpid(), "version": __version__,
                  "started_at": started_at, "data_dir": str(data_dir)}
        paths.write_private_file(_state(PID_FILE, state_dir), f"{os.getpid()}\n")
        paths.write_private_file(_state(INFO_FILE, state_dir), json.dumps(record) + "\n")
        print(f"loops local server {__version__} listening on {url} (data: {data_dir})",
              flush=True)
        if owner_pid is not None:
            _stop_when_gone(owner_pid)
        try:
            server.run(sockets=[sock])
        finally:
            info = _read_info(state_dir)
            if info is not None and info.get("pid") == os.getpid():
                _clear_records(state_dir)
            sock.close()
