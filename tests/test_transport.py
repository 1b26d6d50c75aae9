"""The one transport (``api.http``): the retry decision as a table, every retry path honouring
Retry-After and giving up at its deadline with the URL and the last status, and creates that
are never re-sent blindly (reconciled through a real fault proxy in front of the real server).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fault_server import FakeTrainer, FaultServer, Reply

from baseten_loops_cli.api.client import LoopsClient
from baseten_loops_cli.api.errors import (
    ConnectionFailedError,
    OperationTimeoutError,
    ServerError,
    ServerShutdownError,
)
from baseten_loops_cli.api.http import HttpClient
from baseten_loops_cli.api.retry import DEFAULT_POLICY, RetryPolicy, RetryState, decide
from baseten_loops_cli.workers import SamplerClient, TrainerClient

# ── the decision function, as a table ────────────────────────────────────────────────────────

_REQ = httpx.Request("POST", "http://h/x")


def resp(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers, request=_REQ)


WORKER = RetryPolicy(max_retries=None, deadline=10.0, unavailable_limit=2, unreachable_limit=5.0)
SAMPLE = WORKER.replace(retry_timeouts=False)
S0 = RetryState(started=0.0)

# (id, policy, outcome, state, now, repeatable, accept, expected (action, delay, flags))
TABLE = [
    ("2xx returns", DEFAULT_POLICY, resp(200), S0, 0, False, (), ("return", 0.0, "")),
    ("202 returns", DEFAULT_POLICY, resp(202), S0, 0, True, (), ("return", 0.0, "")),
    ("404 raises", DEFAULT_POLICY, resp(404), S0, 0, True, (), ("raise", 0.0, "")),
    ("accepted 404 returns", DEFAULT_POLICY, resp(404), S0, 0, True, (404,), ("return", 0.0, "")),
    ("accepted 408 is not retried", DEFAULT_POLICY, resp(408), S0, 0, True, (408,), ("return", 0.0, "")),
    ("502 repeatable: backoff", DEFAULT_POLICY, resp(502), S0, 0, True, (), ("retry", 0.5, "")),
    ("502 backoff doubles", DEFAULT_POLICY, resp(502), RetryState(0.0, attempt=2, backoffs=2), 0, True, (),
     ("retry", 2.0, "")),
    ("backoff is capped", DEFAULT_POLICY.replace(max_retries=None), resp(502), RetryState(0.0, attempt=9, backoffs=9), 0,
     True, (), ("retry", 8.0, "")),
    ("immediate resends and Retry-After waits do not double the backoff", DEFAULT_POLICY, resp(502),
     RetryState(0.0, attempt=2, last="HTTP 429"), 0, True, (), ("retry", 0.5, "")),
    ("502 not repeatable: maybe applied", DEFAULT_POLICY, resp(502), S0, 0, False, (), ("raise", 0.0, "maybe_applied")),
    ("500 not repeatable: maybe applied", DEFAULT_POLICY, resp(500), S0, 0, False, (), ("raise", 0.0, "maybe_applied")),
    ("408 not repeatable: maybe applied", DEFAULT_POLICY, resp(408), S0, 0, False, (), ("raise", 0.0, "maybe_applied")),
    ("429 not repeatable: Retry-After", DEFAULT_POLICY, resp(429, **{"Retry-After": "3"}), S0, 0, False, (),
     ("retry", 3.0, "")),
    ("503 + Retry-After not repeatable", DEFAULT_POLICY, resp(503, **{"Retry-After": "2"}), S0, 0, False, (),
     ("retry", 2.0, "")),
    ("retry-after-ms", DEFAULT_POLICY, resp(429, **{"retry-after-ms": "1500"}), S0, 0, True, (), ("retry", 1.5, "")),
    ("Retry-After capped", DEFAULT_POLICY, resp(429, **{"Retry-After": "1000"}), S0, 0, True, (), ("retry", 60.0, "")),
    ("Retry-After on a 502", DEFAULT_POLICY, resp(502, **{"Retry-After": "4"}), S0, 0, True, (), ("retry", 4.0, "")),
    ("retries spent", DEFAULT_POLICY, resp(502), RetryState(0.0, attempt=3), 0, True, (), ("raise", 0.0, "gave_up")),
    ("deadline spent", WORKER, resp(502), S0, 10.0, True, (), ("raise", 0.0, "gave_up")),
    ("wait cut at the deadline", WORKER, resp(429, **{"Retry-After": "5"}), S0, 8.0, True, (), ("retry", 2.0, "")),
    ("503 blip tolerated", WORKER, resp(503), RetryState(0.0, unavailable=1), 0, True, (), ("retry", 0.5, "")),
    ("503s past the limit: shutdown", WORKER, resp(503), RetryState(0.0, unavailable=2), 0, True, (),
     ("raise", 0.0, "shutdown")),
    ("connect error: never sent, any request, first retry at once", DEFAULT_POLICY, httpx.ConnectError("refused"), S0,
     0, False, (), ("retry", 0.0, "")),
    ("reset after send, repeatable: first retry at once", DEFAULT_POLICY, httpx.RemoteProtocolError("reset"), S0, 0,
     True, (), ("retry", 0.0, "")),
    ("second reset in a row backs off", DEFAULT_POLICY, httpx.ReadError("reset"),
     RetryState(0.0, attempt=1, down_since=0.0, last="RemoteProtocolError"), 0, True, (), ("retry", 0.5, "")),
    ("a reset after a 503 is resent at once", DEFAULT_POLICY, httpx.ReadError("reset"),
     RetryState(0.0, attempt=1, backoffs=1, last="HTTP 503"), 0, True, (), ("retry", 0.0, "")),
    ("408 repeatable: first retry at once", DEFAULT_POLICY, resp(408), S0, 0, True, (), ("retry", 0.0, "")),
    ("second 408 in a row backs off", DEFAULT_POLICY, resp(408), RetryState(0.0, attempt=1, last="HTTP 408"), 0, True, (),
     ("retry", 0.5, "")),
    ("a 408 after a 502 is resent at once", DEFAULT_POLICY, resp(408), RetryState(0.0, attempt=1, backoffs=1, last="HTTP 502"),
     0, True, (), ("retry", 0.0, "")),
    ("503 without Retry-After: backoff from the first", DEFAULT_POLICY, resp(503), S0, 0, True, (), ("retry", 0.5, "")),
    ("reset after send, not repeatable", DEFAULT_POLICY, httpx.ReadError("reset"), S0, 0, False, (),
     ("raise", 0.0, "maybe_applied")),
    ("read timeout, not repeatable", DEFAULT_POLICY, httpx.ReadTimeout("slow"), S0, 0, False, (),
     ("raise", 0.0, "maybe_applied")),
    ("read timeout while sampling: no retry", SAMPLE, httpx.ReadTimeout("slow"), S0, 0, True, (), ("raise", 0.0, "")),
    ("connect timeout while sampling: retry", SAMPLE, httpx.ConnectTimeout("slow"), S0, 0, True, (), ("retry", 0.0, "")),
    ("unreachable too long", WORKER, httpx.ConnectError("refused"), RetryState(0.0, down_since=1.0), 6.0, True, (),
     ("raise", 0.0, "gave_up")),
    ("not a transport failure", DEFAULT_POLICY, httpx.UnsupportedProtocol("ftp"), S0, 0, True, (), ("raise", 0.0, "")),
]


@pytest.mark.parametrize("case", TABLE, ids=[row[0] for row in TABLE])
def test_decision_table(case):
    _, policy, outcome, state, now, repeatable, accept, (action, delay, flag) = case
    decision, after = decide(policy, outcome, state, now=now, repeatable=repeatable, rng=lambda: 1.0, accept=accept)
    assert decision.action == action
    assert decision.delay == pytest.approx(delay)
    for name in ("gave_up", "maybe_applied", "shutdown"):
        assert getattr(decision, name) == (name == flag or (flag == "shutdown" and name == "gave_up")), name
    assert after.attempt == state.attempt + (action == "retry")
    # Only a backoff wait raises the exponent: not a resend at once, not a server's Retry-After.
    server_said = isinstance(outcome, httpx.Response) and {"retry-after", "retry-after-ms"} & set(outcome.headers)
    backed_off = action == "retry" and delay > 0 and not server_said
    assert after.backoffs == state.backoffs + backed_off
    assert after.last == (f"HTTP {outcome.status_code}" if isinstance(outcome, httpx.Response) else type(outcome).__name__)


def test_retry_if_makes_a_status_retryable():
    decision, _ = decide(WORKER, resp(404), S0, now=0, repeatable=True, rng=lambda: 1.0, retry_if=lambda r: True)
    assert decision.action == "retry"


def test_state_tracks_unavailable_and_unreachable():
    _, st = decide(WORKER, resp(503), S0, now=0, repeatable=True, rng=lambda: 0.0)
    _, st = decide(WORKER, resp(503), st, now=0, repeatable=True, rng=lambda: 0.0)
    assert st.unavailable == 2
    _, st = decide(WORKER, httpx.ConnectError("x"), st, now=3.0, repeatable=True, rng=lambda: 0.0)
    assert st.unavailable == 0 and st.down_since == 3.0
    _, st = decide(WORKER, resp(502), st, now=4.0, repeatable=True, rng=lambda: 0.0)
    assert st.down_since is None


# ── every retry path: Retry-After honoured, deadline kept, URL + last status on giving up ────

RETRY_AFTER = "0.1"


@pytest.fixture
def server():
    srv = FaultServer()
    yield srv
    srv.close()


class Clock:
    """Records the waits and really waits (a little)."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        time.sleep(seconds)


def assert_gave_up(err: BaseException, url: str, status: str, waits: list[float]) -> None:
    text = str(err)
    assert url in text and status in text and "gave up after" in text, text
    assert waits and waits[0] == pytest.approx(float(RETRY_AFTER))
    assert all(w <= float(RETRY_AFTER) + 1e-9 for w in waits), waits


def test_control_plane_gives_up_after_its_retries(server):
    server.route("GET", "/v1/x", lambda r: Reply(503, {"detail": "busy"}, headers={"Retry-After": RETRY_AFTER}))
    clock = Clock()
    with HttpClient(server.url, "k", max_retries=3, sleep=clock) as http, pytest.raises(ServerError) as info:
        http.get("/v1/x")
    assert_gave_up(info.value, f"{server.url}/v1/x", "HTTP 503", clock.waits)
    assert len(clock.waits) == 3 and "4 attempts" in str(info.value)


def test_control_plane_deadline(server):
    server.route("GET", "/v1/x", lambda r: Reply(502, headers={"Retry-After": RETRY_AFTER}))
    clock = Clock()
    policy = RetryPolicy(max_retries=None, deadline=0.35)
    with HttpClient(server.url, "k", policy=policy, sleep=clock) as http, pytest.raises(ServerError) as info:
        http.get("/v1/x")
    assert sum(clock.waits) <= 0.35 + 1e-9, clock.waits  # never planned a wait past its deadline
    assert_gave_up(info.value, f"{server.url}/v1/x", "HTTP 502", clock.waits)


def test_trainer_submit_deadline(server):
    FakeTrainer(server)
    server.route("POST", "/trainer/optim_step", lambda r: Reply(502, headers={"Retry-After": RETRY_AFTER}))
    server._routes.insert(0, server._routes.pop())
    clock = Clock()
    tc = TrainerClient(f"{server.url}/trainer", api_key="k", run_id="r", base_model="m", submit_timeout=0.35, sleep=clock)
    with pytest.raises(ServerError) as info:
        tc.optim_step()
    assert_gave_up(info.value, f"{server.url}/trainer/optim_step", "HTTP 502", clock.waits)
    assert len({r.header("idempotency-key") for r in server.requests_to("POST", "/trainer/optim_step")}) == 1


def test_trainer_poll_deadline(server):
    trainer = FakeTrainer(server, pending_polls=0)
    clock = Clock()
    tc = TrainerClient(f"{server.url}/trainer", api_key="k", run_id="r", base_model="m", sleep=clock)
    fut = tc.forward([])
    server.route("GET", "/trainer/operations/*", lambda r: Reply(503, headers={"Retry-After": RETRY_AFTER}))
    server._routes.insert(0, server._routes.pop())
    with pytest.raises(OperationTimeoutError) as info:
        fut.result(timeout=0.35)
    assert_gave_up(info.value, f"{server.url}/trainer/operations/", "HTTP 503", clock.waits)
    assert trainer.applied  # the op itself was accepted


def test_worker_get_gives_up_after_its_retries(server):
    server.route("GET", "/trainer/policy_version", lambda r: Reply(429, headers={"Retry-After": RETRY_AFTER}))
    clock = Clock()
    tc = TrainerClient(f"{server.url}/trainer", api_key="k", run_id="r", base_model="m", get_retries=2, sleep=clock)
    with pytest.raises(Exception) as info:
        tc.policy_version()
    assert_gave_up(info.value, f"{server.url}/trainer/policy_version", "HTTP 429", clock.waits)
    assert len(clock.waits) == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sample_deadline(server, mode, monkeypatch):
    server.route("POST", "/s/sample", lambda r: Reply(503, headers={"Retry-After": RETRY_AFTER}))
    clock = Clock()
    real_sleep = asyncio.sleep

    async def recorded_sleep(seconds, *args):  # the async send waits with asyncio.sleep
        if seconds:
            clock.waits.append(seconds)
        return await real_sleep(seconds, *args)

    monkeypatch.setattr(asyncio, "sleep", recorded_sleep)
    sc = SamplerClient(f"{server.url}/s", api_key="k", run_id="r", ready_timeout=0.35, sleep=clock)
    with pytest.raises(ServerError) as info:
        if mode == "sync":
            sc.sample([1])
        else:
            async def go():
                try:
                    return await sc.asample([1])
                finally:
                    await sc.aclose()

            asyncio.run(go())
    assert clock.waits and sum(clock.waits) <= 0.35 + 1e-9, clock.waits  # gave up at its deadline
    text = str(info.value)
    assert f"{server.url}/s/sample" in text and "HTTP 503" in text and "gave up after" in text, text
    if mode == "sync":  # the async path waits with asyncio.sleep
        assert_gave_up(info.value, f"{server.url}/s/sample", "HTTP 503", clock.waits)


def test_queued_sample_poll_deadline(server):
    server.route("POST", "/s/sample", lambda r: Reply(202, {"operation_id": "op1"}))
    server.route("GET", "/s/operations/op1", lambda r: Reply(502, headers={"Retry-After": RETRY_AFTER}))
    server.route("POST", "/s/operations/op1/cancel", lambda r: Reply(200, {}))
    clock = Clock()
    sc = SamplerClient(f"{server.url}/s", api_key="k", run_id="r", ready_timeout=0.35, sleep=clock)
    with pytest.raises(OperationTimeoutError) as info:
        sc.sample([1])
    assert_gave_up(info.value, f"{server.url}/s/operations/op1", "HTTP 502", clock.waits)
    assert len(server.requests_to("POST", "/s/operations/op1/cancel")) == 1


def test_worker_503s_without_retry_after_end_as_shutdown_naming_the_url(server):
    server.route("POST", "/s/sample", lambda r: Reply(503))
    sc = SamplerClient(f"{server.url}/s", api_key="k", run_id="r", max_unavailable_retries=2, sleep=lambda s: None)
    with pytest.raises(ServerShutdownError) as info:
        sc.sample([1])
    assert f"{server.url}/s/sample" in str(info.value) and "HTTP 503 3 times" in str(info.value)


def test_connection_refused_gives_up_naming_the_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clock = Clock()
    with HttpClient(f"http://127.0.0.1:{port}", "k", policy=RetryPolicy(max_retries=None, deadline=0.3,
                                                                         initial_backoff=0.05), sleep=clock) as http:
        with pytest.raises(ConnectionFailedError) as info:
            http.get("/v1/x")
    assert f"127.0.0.1:{port}/v1/x" in str(info.value)
    assert "gave up after" in str(info.value) and "could not reach" in str(info.value)


def test_download_honours_retry_after_then_gives_up_naming_the_link(server, tmp_path):
    from baseten_loops_cli.api.download import DownloadError, download_files

    body = b"x" * 1000
    server.script("GET", "/files/a.bin", Reply(503, headers={"Retry-After": RETRY_AFTER}))
    server.route("GET", "/files/a.bin", lambda r: Reply(200, body=body))
    server.route("GET", "/files/b.bin", lambda r: Reply(429, headers={"Retry-After": RETRY_AFTER}))
    clock = Clock()
    got = download_files([{"relative_file_name": "a.bin", "url": f"{server.url}/files/a.bin?sig=s3cret", "size_bytes": 1000}],
                         tmp_path / "a", checkpoint_id="c", sleep=clock, check_free_space=False)  # fmt: skip
    assert got.bytes_downloaded == 1000 and clock.waits == [pytest.approx(0.1)]
    assert server.requests_to("GET", "/files/a.bin")[0].header("authorization") is None  # presigned: no key
    clock = Clock()
    with pytest.raises(DownloadError) as info:
        download_files([{"relative_file_name": "b.bin", "url": f"{server.url}/files/b.bin?sig=s3cret", "size_bytes": 10}],
                       tmp_path / "b", checkpoint_id="c", sleep=clock, check_free_space=False)  # fmt: skip
    text = str(info.value)
    assert f"{server.url}/files/b.bin" in text and "HTTP 429" in text and "giving up after 5 attempts" in text, text
    assert "s3cret" not in text and clock.waits == [pytest.approx(0.1)] * 4


# ── creates are reconciled, never re-sent blindly ────────────────────────────────────────────


def _run(rid: str, session: str = "s1", age_s: float = 0.0) -> dict:
    from datetime import datetime, timedelta, timezone

    created = (datetime.now(timezone.utc) - timedelta(seconds=age_s)).isoformat()
    return {"id": rid, "session_id": session, "base_model": "b", "name": "n", "status": {"name": "ACTIVE"},
            "created_at": created}


def test_create_finds_what_a_502_made_and_deactivates_a_duplicate(server):
    """The POST is answered 502 (the server made run r1 anyway), the listing lags behind, so
    the create is sent again and makes r2; once both are listed, r2 is deactivated."""
    server.script("POST", "/v1/loops/runs", Reply(502))
    server.route("POST", "/v1/loops/runs", lambda r: Reply(200, {"run": _run("r2")}))
    # r0: made in the same session an hour ago (not by this create): never taken, never deactivated.
    server.script("GET", "/v1/loops/runs", Reply(200, {"runs": [_run("r0", age_s=3600)]}))
    server.route("GET", "/v1/loops/runs", lambda r: Reply(200, {"runs": [_run("r2"), _run("r1", age_s=1), _run("r0", age_s=3600),
                                                                         _run("x", session="other")]}))
    server.route("POST", "/v1/loops/runs/*/deactivate", lambda r: Reply(200, {"id": r.path.split("/")[-2]}))
    with LoopsClient(server.url, "k", sleep=lambda s: None) as client:
        run = client.runs.create({"session_id": "s1", "base_model": "b", "name": "n"})
    assert run.id == "r2"
    assert [r.path for r in server.requests_to("POST", "/v1/loops/runs/*/deactivate")] == ["/v1/loops/runs/r1/deactivate"]
    assert len(server.requests_to("POST", "/v1/loops/runs")) == 2


def test_create_that_keeps_failing_gives_up_naming_url_and_status(server):
    server.route("POST", "/v1/loops/runs", lambda r: Reply(502, headers={"Retry-After": RETRY_AFTER}))
    server.route("GET", "/v1/loops/runs", lambda r: Reply(200, {"runs": []}))
    clock = Clock()
    with LoopsClient(server.url, "k", sleep=clock) as client, pytest.raises(ServerError) as info:
        client.runs.create({"session_id": "s1", "base_model": "b"})
    assert_gave_up(info.value, f"{server.url}/v1/loops/runs", "HTTP 502", clock.waits)
    assert len(server.requests_to("POST", "/v1/loops/runs")) == 4  # 1 + max_retries
    assert len(server.requests_to("GET", "/v1/loops/runs")) == 3  # looked for before each re-send


def test_deploy_is_never_resent(server):
    server.route("POST", "/v1/loops/checkpoints/deploy", lambda r: Reply(502))
    with LoopsClient(server.url, "k", sleep=lambda s: None) as client, pytest.raises(ServerError) as info:
        client.checkpoints.deploy(["ck"], model_name="m", instance_type_id="cpu")
    assert len(server.requests) == 1 and "may have been created" in info.value.hint


# ── through the real fault proxy, in front of the real local server ────────────────────────


@pytest.mark.parametrize("kind", ["502_after", "reset_after", "hang_after"])
def test_run_creation_applied_then_failed_leaves_exactly_one_active_run(local_server, kind):
    """The gateway applies the run creation, then answers 502 / resets / never answers: the
    session ends with exactly one run, the one returned, and nothing else ACTIVE in it."""
    from types import SimpleNamespace

    from baseten_loops_cli.training.session import _create_run
    from tests.faultproxy import FaultProxy

    seen = {"n": 0}

    def first_run_create(k, method, path):
        if method == "POST" and path.rstrip("/").endswith("/loops/runs"):
            seen["n"] += 1
            return seen["n"] == 1
        return False

    config = SimpleNamespace(base_model="loops-local/tiny", name=f"applied-{kind}", lora_rank=4, max_seq_len=64, seed=1)
    port = httpx.URL(local_server.url).port
    with FaultProxy("127.0.0.1", port, rate=1.0, mix=[kind], allow=first_run_create) as proxy:
        with LoopsClient(proxy.url, local_server.token, timeout=httpx.Timeout(3.0, connect=5.0)) as client:
            run = _create_run(client, config)
        snap = proxy.snapshot()
    assert snap["by_kind"] == {kind: 1}, snap
    with local_server.client() as c:
        runs = [r for r in c.get("/v1/loops/runs").json()["runs"] if r.get("session_id") == run.session_id]
    # (On a slow machine the first create may outlast the client's timeout and a second one be
    # sent: then one of the two is deactivated.)
    assert [r["id"] for r in runs if r["status"]["name"] == "ACTIVE"] == [run.id], runs
    assert 1 <= len(runs) <= 2
    with LoopsClient(local_server.url, local_server.token) as client:
        client.runs.deactivate(run.id)


def test_train_run_through_a_gateway_that_applies_the_create_then_answers_502(local_server, tmp_path):
    """`loops train run` when the run creation is applied and then answered 502: the command
    succeeds on exactly one run, the one it reports; no other run of its session is ACTIVE."""
    import json

    from tests.faultproxy import FaultProxy
    from tests.support import cli_env
    from tests.test_reliability_faults import loops, sft_config

    config = sft_config(tmp_path, steps=2, save_every=0)
    config.write_text(config.read_text().replace("name: reliability-sft", "name: applied-then-502"))
    seen = {"n": 0}

    def first_run_create(k, method, path):
        if method == "POST" and path.rstrip("/").endswith(("/loops/runs", "/loops/trainers")):
            seen["n"] += 1
            return seen["n"] == 1
        return False

    with FaultProxy("127.0.0.1", httpx.URL(local_server.url).port, rate=1.0, mix=["502_after"],
                    allow=first_run_create) as proxy:  # fmt: skip
        p = loops(["train", "run", str(config), "--run-dir", str(tmp_path / "rd")], cli_env(local_server, LOOPS_BASE_URL=proxy.url), tmp_path)
        snap = proxy.snapshot()
    assert p.returncode == 0, f"{snap}\n{p.stderr}"
    assert snap["by_kind"] == {"502_after": 1}, snap
    reported = json.loads((tmp_path / "rd" / "state.json").read_text())["run_id"]
    assert reported in p.stderr + p.stdout
    with local_server.client() as c:
        runs = c.get("/v1/loops/runs").json()["runs"]
    session = next(r["session_id"] for r in runs if r["id"] == reported)
    mine = [r for r in runs if r["session_id"] == session]
    assert [r["id"] for r in mine if r["status"]["name"] == "ACTIVE"] in ([], [reported]), mine
    assert len([r for r in runs if r.get("name") == "applied-then-502"]) == len(mine) <= 2
