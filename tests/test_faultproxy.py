"""The fault proxy's own tests, against a trivial threaded upstream on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.faultproxy import BODY_FAULTS, DEFAULT_MIX, FAULT_KINDS, FaultProxy

BIG = bytes(range(256)) * 4096  # 1 MiB


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.hits: list[tuple[str, str]] = []
        self.applied: dict[str, int] = {}  # idempotency key -> times the op was applied
        self.deliveries: dict[str, int] = {}  # idempotency key -> times a request arrived
        self.answered: list[str] = []  # paths of /sleep requests that slept to the end


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Upstream

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes, ctype: str = "application/json", extra=()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._send(200, b"x" * 10)

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.hits.append(("GET", self.path))
        if self.path.startswith("/big"):
            self._send(200, BIG, "application/octet-stream")
        elif self.path.startswith("/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path.startswith("/close-delimited"):
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"until-eof")
            self.close_connection = True
        elif self.path.startswith("/nocontent"):
            self.send_response(204)
            self.end_headers()
        elif self.path.startswith("/sleep"):
            time.sleep(float(self.path.split("=", 1)[1]))
            with self.server.lock:
                self.server.answered.append(self.path)
            self._send(200, b'{"slept": true}')
        else:
            self._send(200, json.dumps({"path": self.path}).encode())

    def do_POST(self) -> None:
        body = self._body()
        key = self.headers.get("Idempotency-Key")
        with self.server.lock:
            self.server.hits.append(("POST", self.path))
            if key:
                self.server.deliveries[key] = self.server.deliveries.get(key, 0) + 1
                first = key not in self.server.applied
                if first:
                    self.server.applied[key] = 1
        if self.path.startswith("/submit"):
            self._send(202, json.dumps({"operation_id": key, "first": first}).encode())
        else:
            self._send(200, json.dumps({"len": len(body), "sha": hashlib.sha256(body).hexdigest()}).encode())


@pytest.fixture()
def upstream():
    srv = _Upstream()
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(proxy: FaultProxy, **kw) -> httpx.Client:
    return httpx.Client(base_url=proxy.url, timeout=httpx.Timeout(10.0), **kw)


# ── transparency at rate 0 ──────────────────────────────────────────────────────────────────


def test_transparent_when_rate_is_zero(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=0.0) as proxy, _client(proxy) as c:
        assert c.get("/hello?x=1").json() == {"path": "/hello?x=1"}
        payload = b"\x00\x01binary" * 50_000
        r = c.post("/echo", content=payload)
        assert r.json() == {"len": len(payload), "sha": hashlib.sha256(payload).hexdigest()}
        # chunked request body (a generator has no length)
        r = c.post("/echo", content=(p for p in [b"ab", b"cd", b"ef"]))
        assert r.json()["len"] == 6
        r = c.get("/big")
        assert r.content == BIG
        assert c.get("/chunked").content == b"hello chunked world"
        assert c.get("/close-delimited").content == b"until-eof"
        assert c.get("/nocontent").status_code == 204
        assert c.head("/anything").status_code == 200
        for _ in range(20):  # keep-alive across many requests on one client
            assert c.get("/again").status_code == 200
        snap = proxy.snapshot()
    assert snap["injected"] == 0
    assert snap["requests"] == snap["forwarded"] == 28


def test_listens_on_loopback_only_and_refuses_remote_upstream(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port) as proxy:
        assert proxy.url.startswith("http://127.0.0.1:")
        sock = proxy._server.sockets[0]  # noqa: SLF001 - the bound address is the point
        assert sock.getsockname()[0] == "127.0.0.1"
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("10.0.0.1", 80)
    with pytest.raises(ValueError, match="unknown fault kinds"):
        FaultProxy("127.0.0.1", 80, mix=["teleport"])


# ── each fault kind at rate 1 ───────────────────────────────────────────────────────────────


@pytest.mark.parametrize("kind", ["502", "503", "408"])
def test_status_faults_without_retry_after(upstream, kind):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=[kind]) as proxy, _client(proxy) as c:
        r = c.get("/x")
        assert r.status_code == int(kind)
        assert "retry-after" not in r.headers
        assert "fault injected" in r.json()["detail"]
        assert proxy.counts == {kind: 1}
        assert proxy.forwarded == 0
        assert proxy.snapshot()["imposed_s"] == 0  # no wait asked for
    assert upstream.hits == []


@pytest.mark.parametrize("kind", ["502_retry_after", "503_retry_after"])
def test_status_faults_with_retry_after(upstream, kind):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=[kind], retry_after_s=2) as proxy:
        with _client(proxy) as c:
            r = c.post("/submit", headers={"Idempotency-Key": "k1"}, json={})
    assert r.status_code == int(kind[:3])
    assert r.headers["retry-after"] == "2"
    assert proxy.snapshot()["imposed_s"] == 2  # the wait it asked the client for
    assert upstream.hits == []


def test_reset_before_forwarding(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["reset"]) as proxy, _client(proxy) as c:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            c.post("/submit", headers={"Idempotency-Key": "k1"}, json={})
        assert proxy.counts["reset"] == 1
    assert upstream.hits == []  # never reached the server


def test_reset_after_forwarding_loses_the_response(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["reset_after"]) as proxy:
        with _client(proxy) as c:
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                c.post("/submit", headers={"Idempotency-Key": "k1"}, json={})
    assert upstream.applied == {"k1": 1}  # applied, but the client never heard


def test_delay(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["delay"], delay_s=0.4) as proxy:
        with _client(proxy) as c:
            t0 = time.monotonic()
            assert c.get("/x").status_code == 200
            assert time.monotonic() - t0 >= 0.38  # a lower bound: load only lengthens it
    assert len(upstream.hits) == 1
    assert proxy.snapshot()["imposed_s"] == pytest.approx(0.4)


def test_replay_forwards_twice_and_returns_second_response(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["replay"]) as proxy, _client(proxy) as c:
        r = c.post("/submit", headers={"Idempotency-Key": "k1"}, json={"a": 1})
        assert proxy.forwarded == 2
    assert r.status_code == 202
    # The server saw the request twice; the client got the *second* answer (a dedupe hit).
    assert upstream.deliveries == {"k1": 2}
    assert upstream.applied == {"k1": 1}
    assert r.json() == {"operation_id": "k1", "first": False}


def test_replay_of_streamed_response(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["replay"]) as proxy, _client(proxy) as c:
        assert c.get("/big").content == BIG
        assert c.get("/chunked").content == b"hello chunked world"
    assert len(upstream.hits) == 4


def test_truncate_cuts_the_body_and_resets(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["truncate"]) as proxy, _client(proxy) as c:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            c.get("/big")
        # Streaming shows what got through: the head and half the body.
        proxy.set_rate(0.0)
        assert c.get("/big").content == BIG


def test_truncate_streamed_read_sees_half(upstream):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["truncate"]) as proxy:
        got = bytearray()
        with httpx.Client(timeout=10) as c:
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                with c.stream("GET", proxy.url + "/big") as r:
                    assert r.headers["content-length"] == str(len(BIG))
                    for chunk in r.iter_raw():
                        got += chunk
    assert 0 < len(got) < len(BIG) and bytes(got) == BIG[: len(got)]


@pytest.mark.parametrize("path,expected", [("/big", BIG), ("/chunked", b"hello chunked world")])
def test_corrupt_flips_one_byte_same_length(upstream, path, expected):
    with FaultProxy("127.0.0.1", upstream.server_port, rate=1.0, mix=["corrupt"]) as proxy, _client(proxy) as c:
        body = c.get(path).content
        assert proxy.counts == {"corrupt": 1}
    assert len(body) == len(expected) and body != expected
    assert sum(a != b for a, b in zip(body, expected)) == 1


# ── seeding, rate, filters ──────────────────────────────────────────────────────────────────


def _fault_sequence(port: int, seed: int, n: int = 60) -> list[str | None]:
    with FaultProxy("127.0.0.1", port, rate=0.3, seed=seed, mix=["502", "503", "408"]) as proxy:
        with _client(proxy) as c:
            for i in range(n):
                c.get(f"/seq/{i}")
        return [e.fault for e in proxy.events_list()]


def test_seed_makes_the_fault_sequence_reproducible(upstream):
    a = _fault_sequence(upstream.server_port, seed=11)
    b = _fault_sequence(upstream.server_port, seed=11)
    c = _fault_sequence(upstream.server_port, seed=12)
    assert a == b
    assert a != c
    assert any(a) and not all(a)


def test_rate_and_mix_are_respected(upstream):
    n = 600
    with FaultProxy("127.0.0.1", upstream.server_port, rate=0.2, seed=3, delay_s=0.0, retry_after_s=0) as proxy:
        with _client(proxy) as c:  # httpx drops a reset connection and opens a new one
            for _ in range(n):
                try:
                    c.get("/r")
                except httpx.TransportError:
                    pass
        snap = proxy.snapshot()
    assert snap["requests"] == n
    # Binomial(600, 0.2): mean 120, sd ~9.8; +-4 sd.
    assert 80 <= snap["injected"] <= 160, snap
    assert set(snap["by_kind"]) == set(DEFAULT_MIX), snap
    assert not set(BODY_FAULTS) & set(DEFAULT_MIX)  # body faults only when asked for


def test_only_and_exclude_filters(upstream):
    with FaultProxy(
        "127.0.0.1", upstream.server_port, rate=1.0, mix=["503"], only=r"^/trainers/", exclude=r"/health$"
    ) as proxy, _client(proxy) as c:
        assert c.get("/v1/loops/runs").status_code == 200
        assert c.get("/trainers/r1/health").status_code == 200
        assert c.get("/trainers/r1/operations/x").status_code == 503
        assert proxy.counts == {"503": 1}


def test_allow_predicate_and_runtime_reconfiguration(upstream):
    never_replay_posts = lambda kind, method, path: not (kind == "replay" and method == "POST")  # noqa: E731
    with FaultProxy(
        "127.0.0.1", upstream.server_port, rate=1.0, mix=["replay"], allow=never_replay_posts
    ) as proxy, _client(proxy) as c:
        c.post("/submit", headers={"Idempotency-Key": "k"}, json={})
        assert proxy.injected == 0
        proxy.set_mix(["503"])
        assert c.get("/x").status_code == 503
        proxy.set_rate(0.0)
        assert c.get("/x").status_code == 200


# ── robustness of the proxy itself ──────────────────────────────────────────────────────────


def test_upstream_down_looks_like_a_dropped_connection():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with FaultProxy("127.0.0.1", port, rate=0.0) as proxy, _client(proxy) as c:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            c.get("/x")
        assert proxy.requests == 1


def test_stop_is_prompt_with_a_request_in_flight(upstream):
    proxy = FaultProxy("127.0.0.1", upstream.server_port, rate=0.0).start()
    errors: list[BaseException] = []

    def slow():
        try:
            with _client(proxy) as c:
                c.get("/sleep?s=3")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=slow)
    t.start()
    while ("GET", "/sleep?s=3") not in upstream.hits:  # in flight: the upstream is sleeping
        time.sleep(0.01)
    proxy.stop()
    # stop() returned while the upstream was still holding the request: it did not wait for it.
    assert upstream.answered == []
    t.join(10)
    assert errors and isinstance(errors[0], httpx.TransportError)


def test_idempotent_submits_survive_heavy_faults_exactly_once(upstream):
    """What the real trainer client must do, in miniature: retry every fault with the same
    key; the upstream applies each op once though replays and lost responses deliver twice."""
    n_ops, max_attempts = 80, 20
    with FaultProxy(
        "127.0.0.1", upstream.server_port, rate=0.4, seed=5, delay_s=0.01, retry_after_s=0
    ) as proxy, _client(proxy) as c:
        for i in range(n_ops):
            key = f"op-{i}"
            for _attempt in range(max_attempts):
                try:
                    r = c.post("/submit", headers={"Idempotency-Key": key}, json={"i": i})
                except httpx.TransportError:
                    continue
                if r.status_code == 202:
                    assert r.json()["operation_id"] == key
                    break
            else:
                pytest.fail(f"{key} never accepted")
        snap = proxy.snapshot()
    assert upstream.applied == {f"op-{i}": 1 for i in range(n_ops)}
    assert sum(upstream.deliveries.values()) > n_ops  # duplicates really reached the upstream
    assert snap["by_kind"].get("replay", 0) + snap["by_kind"].get("reset_after", 0) > 0


def test_throttle_slows_matching_bodies_only(upstream):
    # The proxy counts what it paced: the property is which bodies are slowed and by how much
    # (by design), not how long this machine took to move them.
    with FaultProxy("127.0.0.1", upstream.server_port, rate=0.0, throttle_bps=2_000_000,
                    throttle_path=r"^/big") as proxy, _client(proxy) as c:
        assert c.get("/big").content == BIG  # 1 MiB at 2 MB/s: ~0.5 s of pacing
        slow = (proxy.throttled_bytes, proxy.throttled_s)
        assert c.get("/chunked").content == b"hello chunked world"
        fast = (proxy.throttled_bytes, proxy.throttled_s)
        proxy.set_throttle(None)
        assert c.get("/big").content == BIG
        unthrottled = (proxy.throttled_bytes, proxy.throttled_s)
    assert slow[0] == len(BIG) and slow[1] == pytest.approx(len(BIG) / 2_000_000), slow
    assert fast == slow and unthrottled == slow, (slow, fast, unthrottled)  # nothing else paced
