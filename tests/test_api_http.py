"""HttpClient retries, typed errors and debug redaction against a real local server."""

from __future__ import annotations

import socket

import httpx
import pytest
from fault_server import FaultServer, Reply

from baseten_loops_cli.api.errors import (
    ApiError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ConnectionFailedError,
    NotFoundError,
    RateLimitedError,
    RequestTimeoutError,
    ServerError,
)
from baseten_loops_cli.api.http import HttpClient
from baseten_loops_cli.api.retry import backoff_delay, retry_after_seconds
from baseten_loops_cli.errors import ExitCode, LoopsError

KEY = "sk-very-secret-key-42"


@pytest.fixture
def server():
    srv = FaultServer()
    yield srv
    srv.close()


@pytest.fixture
def sleeps():
    return []


@pytest.fixture
def client(server, sleeps):
    c = HttpClient(server.url, KEY, timeout=5.0, max_retries=3, sleep=sleeps.append, rng=lambda: 1.0)
    yield c
    c.close()


def ok(req):
    return Reply(200, {"ok": True})


def test_headers(server, client):
    server.route("GET", "/x", ok)
    assert client.request_json("GET", "/x") == {"ok": True}
    req = server.requests[0]
    assert req.header("authorization") == f"Api-Key {KEY}"
    assert req.header("user-agent").startswith("loops/")
    assert req.header("x-baseten-accept-error") == "1"


def test_params_drop_none(server, client):
    server.route("GET", "/x", ok)
    client.get("/x", params={"a": 1, "b": None})
    assert server.requests[0].query == {"a": ["1"]}


@pytest.mark.parametrize(
    "status,headers,expected_sleep",
    [
        (503, {"Retry-After": "2"}, 2.0),
        (503, {}, 0.5),  # GET retries 503 without Retry-After using backoff (rng=1 → 0.5 s)
        (429, {"Retry-After": "3"}, 3.0),
        (429, {"retry-after-ms": "1500"}, 1.5),
        (429, {"Retry-After": "1000"}, 60.0),  # capped
        (502, {}, 0.5),
        (504, {}, 0.5),
        (500, {}, 0.5),
        (408, {}, 0.0),  # the first retry after a 408 is immediate (the server did nothing)
    ],
)
def test_retry_then_success(server, client, sleeps, status, headers, expected_sleep):
    server.script("GET", "/x", Reply(status, {"detail": "busy"}, headers=headers))
    server.route("GET", "/x", ok)
    assert client.get("/x").json() == {"ok": True}
    assert sleeps == [expected_sleep]
    assert len(server.requests) == 2


def test_backoff_grows_and_gives_up(server, client, sleeps):
    server.route("GET", "/x", lambda r: Reply(502, {"error": "bad gateway"}))
    with pytest.raises(ServerError) as info:
        client.get("/x")
    assert sleeps == [0.5, 1.0, 2.0]
    assert len(server.requests) == 4
    assert info.value.status == 502 and "bad gateway" in str(info.value)


def test_post_500_not_retried(server, client, sleeps):
    server.route("POST", "/x", lambda r: Reply(500, {"message": "boom"}))
    with pytest.raises(ServerError):
        client.post("/x", json={})
    assert len(server.requests) == 1 and sleeps == []


def test_post_408_not_retried_unless_safe(server, client):
    server.route("POST", "/x", lambda r: Reply(408))
    with pytest.raises(BadRequestError):
        client.post("/x", json={})
    assert len(server.requests) == 1
    server.script("POST", "/y", Reply(408))
    server.route("POST", "/y", ok)
    client.post("/y", json={}, safe_to_repeat=True)
    assert len(server.requests_to("POST", "/y")) == 2


def test_unsafe_post_not_retried_on_502(server, client):
    server.route("POST", "/deploy", lambda r: Reply(502))
    with pytest.raises(ServerError):
        client.post("/deploy", json={}, safe_to_repeat=False)
    assert len(server.requests) == 1


def test_unsafe_post_retried_on_429(server, client):
    server.script("POST", "/deploy", Reply(429, headers={"Retry-After": "1"}))
    server.route("POST", "/deploy", ok)
    client.post("/deploy", json={}, safe_to_repeat=False)
    assert len(server.requests) == 2


def test_rate_limited_after_retries(server, client):
    server.route("GET", "/x", lambda r: Reply(429, {"detail": "slow down"}, headers={"Retry-After": "7"}))
    with pytest.raises(RateLimitedError) as info:
        client.get("/x")
    assert info.value.retry_after == 7.0 and "7s" in info.value.hint


def test_connection_reset_get_retried(server, client, sleeps):
    server.script("GET", "/x", Reply(reset=True))
    server.route("GET", "/x", ok)
    assert client.get("/x").json() == {"ok": True}
    assert len(sleeps) == 1


def test_connection_reset_post_not_retried(server, client):
    server.route("POST", "/x", lambda r: Reply(reset=True))
    with pytest.raises(ConnectionFailedError) as info:
        client.post("/x", json={})
    assert len(server.requests) == 1
    assert server.url in str(info.value) and KEY not in str(info.value)


def test_read_timeout_get_retried_then_raises(server, sleeps):
    server.route("GET", "/slow", lambda r: Reply(200, {"ok": True}, delay=0.5))
    c = HttpClient(server.url, KEY, timeout=0.1, max_retries=1, sleep=sleeps.append)
    with pytest.raises(RequestTimeoutError) as info:
        c.get("/slow")
    assert len(server.requests) == 2 and "/slow" in str(info.value)
    assert info.value.exit_code == ExitCode.ERROR


def test_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleeps = []
    c = HttpClient(f"http://127.0.0.1:{port}", KEY, max_retries=2, sleep=sleeps.append)
    with pytest.raises(ConnectionFailedError) as info:
        c.get("/v1/loops/runs")
    assert f"127.0.0.1:{port}" in str(info.value) and info.value.hint
    assert len(sleeps) == 2  # connect errors are retried for any method
    assert info.value.exit_code == 1


@pytest.mark.parametrize(
    "status,cls",
    [(401, AuthenticationError), (403, AuthenticationError), (404, NotFoundError), (409, ConflictError),
     (400, BadRequestError), (422, BadRequestError), (410, BadRequestError)],
)  # fmt: skip
def test_typed_errors(server, client, status, cls):
    server.route("GET", "/x", lambda r: Reply(status, {"detail": "nope", "details": {"reason": "WHY"}, "error_class": "E"},
                                              headers={"x-request-id": "req-1"}))  # fmt: skip
    with pytest.raises(cls) as info:
        client.get("/x")
    err = info.value
    assert isinstance(err, ApiError) and isinstance(err, LoopsError)
    assert err.status == status and err.reason == "WHY" and err.error_class == "E" and err.request_id == "req-1"
    assert "\n" not in str(err) and str(err).startswith("nope (HTTP")


def test_auth_error_exit_code_and_hint(server, client):
    server.route("GET", "/x", lambda r: Reply(401, {"error": f"invalid key {KEY}"}))
    with pytest.raises(AuthenticationError) as info:
        client.get("/x")
    assert info.value.exit_code == ExitCode.AUTH == 4
    assert "loops auth login" in info.value.hint
    assert KEY not in str(info.value) and KEY not in (info.value.detail or "")


def test_message_sources(server, client):
    server.script("GET", "/a", Reply(400, {"error": {"type": "BadRequestError", "message": "prompt too long"}}))
    server.script("GET", "/b", Reply(400, body=b"plain text\nproblem"))
    server.script("GET", "/c", Reply(404, {"details": {"reason": "NOT_PRESIGNABLE"}}))
    server.script("GET", "/d", Reply(502, body=b"<html>gateway</html>"))
    msgs = []
    for path in ("/a", "/b", "/c", "/d"):
        with pytest.raises(ApiError) as info:
            client.get(path, max_retries=0)
        msgs.append(str(info.value))
    assert msgs[0] == "prompt too long (HTTP 400 for GET /a)"
    assert msgs[1] == "plain text problem (HTTP 400 for GET /b)"
    assert msgs[2] == "NOT_PRESIGNABLE (HTTP 404 for GET /c)"
    assert msgs[3] == "HTTP 502 for GET /d"


def test_debug_log_redacts_key(server, sleeps):
    lines = []
    server.script("GET", "/x", Reply(503, headers={"Retry-After": "0"}))
    server.route("GET", "/x", lambda r: Reply(200, {"echo": KEY}, headers={"Set-Cookie": "s=abc"}))
    c = HttpClient(server.url, KEY, sleep=sleeps.append, debug_log=lines.append)
    c.get("/x")
    text = "\n".join(lines)
    assert KEY not in text
    assert "Api-Key ***" in text
    assert "-> GET" in text and "<- 503" in text and "<- 200" in text and " ms)" in text
    assert "retry 1/" in text


def test_debug_log_redacts_query_secrets(server, sleeps):
    lines = []
    server.route("GET", "/files", ok)
    c = HttpClient(server.url, KEY, sleep=sleeps.append, debug_log=lines.append)
    c.get("/files", params={"page": 1, "sig": "s3cr3t-signature", "token": "tok-abc-123"})
    text = "\n".join(lines)
    assert "s3cr3t-signature" not in text and "tok-abc-123" not in text and "page=1" in text


def test_a_key_the_header_cannot_carry_is_not_quoted_in_the_error(server, sleeps):
    """httpx refuses the header and quotes it, escaped ("b'Api-Key sk-...\\n'"): that form is
    scrubbed too, and before the message is cut to one line (a cut key is not found)."""
    server.route("GET", "/x", ok)
    for key in (KEY + "\n", KEY[:8] + "\r\n" + KEY[8:], KEY * 8 + "\n"):
        with pytest.raises(ConnectionFailedError) as info:
            HttpClient(server.url, key, sleep=sleeps.append, max_retries=0).get("/x")
        message = info.value.message
        assert KEY[:8] not in message and KEY[8:] not in message, message


def test_retry_after_parsing():
    assert retry_after_seconds({"retry-after": "5"}) == 5.0
    assert retry_after_seconds({"retry-after": "-5"}) == 0.0
    assert retry_after_seconds({"retry-after": "nan"}) is None
    assert retry_after_seconds({"retry-after": "garbage"}) is None
    assert retry_after_seconds({}) is None
    assert retry_after_seconds({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # in the past
    assert retry_after_seconds(httpx.Headers({"Retry-After": "2"})) == 2.0


def test_backoff_full_jitter():
    assert backoff_delay(0, rng=lambda: 1.0) == 0.5
    assert backoff_delay(10, rng=lambda: 1.0) == 8.0
    assert backoff_delay(3, rng=lambda: 0.0) == 0.0
