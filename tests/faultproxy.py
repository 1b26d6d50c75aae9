"""A real TCP/HTTP fault-injection proxy for the reliability tests.

``FaultProxy`` listens on ``127.0.0.1`` (never another interface), forwards HTTP/1.1 requests
to an upstream ``host:port`` and, per request, decides with a seeded RNG whether to inject a
fault instead of (or around) forwarding it:

==================  ==========================================================================
kind                what the client sees
==================  ==========================================================================
``reset``           the connection is reset (TCP RST) before the request is forwarded
``reset_after``     the request IS forwarded and applied upstream, then the connection is reset
                    instead of returning the response (a lost response: the idempotency test)
``502_after``       the request IS forwarded and applied upstream, then ``502`` is answered
                    instead of its response (a gateway failing after the backend acted)
                                                           [not in the default mix]
``hang_after``      the request IS forwarded and applied upstream, then nothing is answered
                    until the client gives up (a timeout after the backend acted)
                                                           [not in the default mix]
``502``             ``502 Bad Gateway`` without forwarding
``502_retry_after`` ``502`` with ``Retry-After`` without forwarding
``503``             ``503 Service Unavailable`` without forwarding
``503_retry_after`` ``503`` with ``Retry-After`` without forwarding
``408``             ``408 Request Timeout`` without forwarding
``delay``           the request is forwarded after ``delay_s`` seconds (a slow response)
``replay``          the request is forwarded twice; the second response is returned (a
                    duplicated delivery, harmless only if the server dedupes idempotency keys)
``truncate``        the response head and half its body are relayed, then the connection is
                    reset (a download cut short)           [not in the default mix]
``corrupt``         the response is relayed with one body byte flipped (same length: only a
                    checksum can tell)                     [not in the default mix]
==================  ==========================================================================

Usage::

    with FaultProxy("127.0.0.1", server_port, rate=0.2, seed=7) as proxy:
        client = TrainerClient(proxy.url + "/trainers/run-1", ...)
        ...
    proxy.counts            # Counter({'502': 4, 'reset': 3, ...})
    proxy.injected          # total faults injected
    proxy.imposed_s         # seconds of waits the faults imposed (delays, Retry-After sent)

The proxy runs its own asyncio loop in a daemon thread, so it works with sync tests and with
subprocesses (the CLI) alike. Every upstream request is sent on a fresh upstream connection;
the client side keeps HTTP/1.1 keep-alive. Bodies (Content-Length or chunked, both directions)
are relayed byte for byte; long-polls and large downloads are streamed, not buffered, except
for the first leg of a ``replay`` (which is read and discarded).
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

LOOPBACK = "127.0.0.1"

FAULT_KINDS: tuple[str, ...] = (
    "reset",
    "reset_after",
    "502",
    "502_retry_after",
    "503",
    "503_retry_after",
    "408",
    "delay",
    "replay",
    "truncate",
    "corrupt",
    "502_after",
    "hang_after",
)

# Body faults: for download tests; they are not in the default mix (a flipped byte in a JSON
# API body is not a transport fault HTTP clients are expected to survive).
BODY_FAULTS = ("truncate", "corrupt")
# Applied-then-failed answers: for the create-reconciliation tests; not in the default mix
# either (only a request without an Idempotency-Key is at risk, and the mix is for all).
APPLIED_FAULTS = ("502_after", "hang_after")

# The mix the issue names: resets, 502/503 with and without Retry-After, 408s, slow responses
# and replays (+ lost responses, the case idempotency keys exist for). Equal weights.
DEFAULT_MIX: dict[str, float] = {kind: 1.0 for kind in FAULT_KINDS if kind not in BODY_FAULTS + APPLIED_FAULTS}

_STATUS_TEXT = {408: "Request Timeout", 502: "Bad Gateway", 503: "Service Unavailable"}
_MAX_HEAD_BYTES = 64 * 1024
_COPY_CHUNK = 64 * 1024


class ProxyProtocolError(Exception):
    """The bytes on the wire were not HTTP/1.1 the proxy can relay."""


@dataclass
class Event:
    """One request seen by the proxy (kept for assertions and for debugging a failing test)."""

    t: float
    method: str
    path: str
    fault: str | None
    upstream_status: int | None = None
    idempotency_key: str | None = None


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body_raw: bytes  # exactly as framed on the wire (chunked stays chunked)

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def wants_close(self) -> bool:
        conn = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" not in conn
        return "close" in conn

    def encode_for_upstream(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1"]
        for k, v in self.headers:
            if k.lower() in ("connection", "keep-alive", "proxy-connection"):
                continue
            lines.append(f"{k}: {v}")
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body_raw


@dataclass
class FaultConfig:
    rate: float = 0.2
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    delay_s: float = 0.5
    retry_after_s: int = 1
    # Only requests whose path matches ``only`` (and not ``exclude``) are candidates for faults.
    only: re.Pattern[str] | None = None
    exclude: re.Pattern[str] | None = None
    # Per-kind predicate: e.g. never replay a non-idempotent control-plane POST.
    allow: Callable[[str, str, str], bool] | None = None  # (kind, method, path) -> bool


class FaultProxy:
    """An HTTP/1.1 proxy on ``127.0.0.1`` that injects faults into a fraction of requests.

    ``rate`` is the probability that a candidate request gets a fault; ``mix`` maps fault kinds
    to relative weights (kinds missing or weighted 0 are never injected). ``seed`` makes the
    sequence of decisions reproducible for a given arrival order of requests.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        rate: float = 0.2,
        seed: int = 0,
        mix: Mapping[str, float] | Iterable[str] | None = None,
        delay_s: float = 0.5,
        retry_after_s: int = 1,
        only: str | None = None,
        exclude: str | None = None,
        allow: Callable[[str, str, str], bool] | None = None,
        listen_port: int = 0,
        keep_events: int = 10_000,
        throttle_bps: float | None = None,
        throttle_path: str | None = None,
    ) -> None:
        if upstream_host not in (LOOPBACK, "localhost", "::1"):
            raise ValueError(f"FaultProxy forwards to loopback only, not {upstream_host!r}")
        self.upstream_host = upstream_host
        self.upstream_port = int(upstream_port)
        self._listen_port = listen_port
        self.config = FaultConfig(
            rate=rate,
            mix=self._normalise_mix(mix),
            delay_s=delay_s,
            retry_after_s=retry_after_s,
            only=re.compile(only) if only else None,
            exclude=re.compile(exclude) if exclude else None,
            allow=allow,
        )
        # Slow every relayed response body (paths matching ``throttle_path``) to this many
        # bytes/s: a slow link, so a test can interrupt a download half way.
        self.throttle_bps = throttle_bps
        self._throttle_path = re.compile(throttle_path) if throttle_path else None
        # What the throttle did (bytes it paced, seconds it slept for them), so a test can
        # check that a body was slowed without timing it.
        self.throttled_bytes = 0
        self.throttled_s = 0.0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        # The waits the faults themselves impose, whatever the client does: each slow
        # response's delay, and each Retry-After sent (a client honours it, as the protocol
        # asks). A bench subtracts them to see what the client's retries add.
        self.imposed_s = 0.0
        self.requests = 0  # requests received from clients
        self.forwarded = 0  # requests sent upstream (a replay counts twice)
        self.events: collections.deque[Event] = collections.deque(maxlen=keep_events)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conn_tasks: set[asyncio.Task] = set()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.port: int | None = None

    # ── configuration ───────────────────────────────────────────────────────────────────────

    @staticmethod
    def _normalise_mix(mix: Mapping[str, float] | Iterable[str] | None) -> dict[str, float]:
        if mix is None:
            return dict(DEFAULT_MIX)
        if not isinstance(mix, Mapping):
            mix = {kind: 1.0 for kind in mix}
        unknown = set(mix) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        out = {k: float(w) for k, w in mix.items() if float(w) > 0}
        return out

    def set_rate(self, rate: float) -> None:
        with self._lock:
            self.config.rate = rate

    def set_throttle(self, bps: float | None) -> None:
        self.throttle_bps = bps

    def set_mix(self, mix: Mapping[str, float] | Iterable[str]) -> None:
        with self._lock:
            self.config.mix = self._normalise_mix(mix)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("FaultProxy is not started")
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def injected(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": self.requests,
                "forwarded": self.forwarded,
                "injected": sum(self.counts.values()),
                "by_kind": dict(self.counts),
                "imposed_s": self.imposed_s,
            }

    def events_list(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    # ── lifecycle ───────────────────────────────────────────────────────────────────────────

    def start(self) -> "FaultProxy":
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run_loop, name="faultproxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("FaultProxy did not start within 10 s")
        if self._start_error is not None:
            raise RuntimeError(f"FaultProxy failed to start: {self._start_error}") from self._start_error
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        try:
            fut.result(timeout=10)
        except Exception:
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = None
        self._loop = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle_client, LOOPBACK, self._listen_port, backlog=512)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conn_tasks):
            task.cancel()
        if self._conn_tasks:
            await asyncio.gather(*self._conn_tasks, return_exceptions=True)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):
                pass

    # ── decisions ───────────────────────────────────────────────────────────────────────────

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            cfg = self.config
            # Draw both numbers for every request so the sequence depends only on the seed and
            # the request order, not on which requests were candidates.
            roll = self._rng.random()
            pick = self._rng.random()
            if cfg.only is not None and not cfg.only.search(path):
                return None
            if cfg.exclude is not None and cfg.exclude.search(path):
                return None
            if roll >= cfg.rate or not cfg.mix:
                return None
            kinds = [k for k in cfg.mix if cfg.allow is None or cfg.allow(k, method, path)]
            if not kinds:
                return None
            total = sum(cfg.mix[k] for k in kinds)
            acc = 0.0
            for kind in kinds:
                acc += cfg.mix[kind] / total
                if pick < acc:
                    return kind
            return kinds[-1]

    def _impose(self, seconds: float) -> None:
        with self._lock:
            self.imposed_s += seconds

    def _record(self, req: _Request, fault: str | None) -> Event:
        ev = Event(time.monotonic(), req.method, req.target, fault, idempotency_key=req.header("idempotency-key"))
        with self._lock:
            self.requests += 1
            if fault is not None:
                self.counts[fault] += 1
            self.events.append(ev)
        return ev

    # ── connection handling ─────────────────────────────────────────────────────────────────

    async def _handle_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        try:
            while True:
                try:
                    req = await _read_request(reader)
                except (ProxyProtocolError, asyncio.IncompleteReadError, ConnectionError):
                    break
                if req is None:  # clean EOF between requests
                    break
                keep_open = await self._serve_one(req, writer)
                if not keep_open or req.wants_close():
                    break
        except asyncio.CancelledError:
            _reset(writer)
            raise
        except (ConnectionError, OSError):
            pass
        finally:
            if task is not None:
                self._conn_tasks.discard(task)
            if not writer.is_closing():
                writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1)
            except Exception:
                pass

    async def _serve_one(self, req: _Request, writer: asyncio.StreamWriter) -> bool:
        """Handle one request; returns whether the client connection can be reused."""
        path = req.target.split("?", 1)[0]
        fault = self._decide(req.method, path)
        ev = self._record(req, fault)
        cfg = self.config

        if fault == "reset":
            _reset(writer)
            return False
        if fault in ("502", "503", "408", "502_retry_after", "503_retry_after"):
            status = int(fault[:3])
            extra = [("Retry-After", str(cfg.retry_after_s))] if fault.endswith("retry_after") else []
            if extra:
                self._impose(cfg.retry_after_s)
            await _write_simple(writer, status, extra, close=(status == 408))
            # A real 408 closes the connection (RFC 9110 §15.5.9); 502/503 keep it.
            return status != 408
        if fault == "delay":
            self._impose(cfg.delay_s)
            await asyncio.sleep(cfg.delay_s)
        if fault == "replay":
            # First delivery: forwarded and fully read, response discarded.
            try:
                status, _ = await self._forward(req, None)
            except (OSError, ProxyProtocolError, asyncio.IncompleteReadError):
                pass
        if fault in BODY_FAULTS:
            try:
                status, head, body = await self._forward_buffered(req)
            except (OSError, ProxyProtocolError, asyncio.IncompleteReadError):
                _reset(writer)
                return False
            ev.upstream_status = status
            if not body:  # nothing to damage: relay as is
                writer.write(head + body)
                await writer.drain()
                return True
            if fault == "truncate":
                writer.write(head + body[: len(body) // 2])
                await writer.drain()
                _reset(writer)
                return False
            damaged = bytearray(body)
            damaged[len(damaged) // 2] ^= 0xFF
            writer.write(head + bytes(damaged))
            await writer.drain()
            return True
        if fault in APPLIED_FAULTS:
            try:
                status, _ = await self._forward(req, None)
                ev.upstream_status = status
            except (OSError, ProxyProtocolError, asyncio.IncompleteReadError):
                pass
            if fault == "502_after":
                await _write_simple(writer, 502, [], close=False)
                return True
            # Hold the connection without a word: the client times out first (the proxy's stop
            # cancels the wait).
            await asyncio.sleep(120)
            _reset(writer)
            return False
        if fault == "reset_after":
            try:
                status, _ = await self._forward(req, None)
                ev.upstream_status = status
            except (OSError, ProxyProtocolError, asyncio.IncompleteReadError):
                pass
            _reset(writer)
            return False
        try:
            status, reusable = await self._forward(req, writer)
        except (OSError, ProxyProtocolError, asyncio.IncompleteReadError):
            # Upstream refused or died mid-response: the client sees a dropped connection,
            # exactly as it would without the proxy.
            _reset(writer)
            return False
        ev.upstream_status = status
        return reusable

    async def _forward_buffered(self, req: _Request) -> tuple[int, bytes, bytes]:
        """Forward ``req`` and read the whole response: (status, head re-framed with a
        Content-Length, decoded body)."""
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        with self._lock:
            self.forwarded += 1
        try:
            up_writer.write(req.encode_for_upstream())
            await up_writer.drain()
            while True:
                status, head_lines = await _read_response_head(up_reader)
                if not (100 <= status < 200 and status != 101):
                    break
            headers = _parse_header_lines(head_lines[1:])
            te = _get(headers, "transfer-encoding")
            cl = _get(headers, "content-length")
            if req.method == "HEAD" or status in (204, 304):
                body = b""
            elif te and "chunked" in te.lower():
                body = _dechunk(await _read_chunked_raw(up_reader))
            elif cl is not None:
                body = await up_reader.readexactly(int(cl))
            else:
                body = await up_reader.read()
            out_lines = [head_lines[0]]
            for k, v in headers:
                if k.lower() in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                    continue
                out_lines.append(f"{k}: {v}")
            if not (req.method == "HEAD" or status in (204, 304)):
                out_lines.append(f"Content-Length: {len(body)}")
            head = ("\r\n".join(out_lines) + "\r\n\r\n").encode("latin-1")
            return status, head, body
        finally:
            up_writer.close()
            try:
                await asyncio.wait_for(up_writer.wait_closed(), 1)
            except Exception:
                pass

    async def _forward(self, req: _Request, writer: asyncio.StreamWriter | None) -> tuple[int, bool]:
        """Send ``req`` upstream on a fresh connection; relay the response to ``writer`` (or
        read and discard it when ``writer`` is None). Returns (status, client-reusable)."""
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        with self._lock:
            self.forwarded += 1
        try:
            up_writer.write(req.encode_for_upstream())
            await up_writer.drain()
            while True:
                status, head_lines = await _read_response_head(up_reader)
                if 100 <= status < 200 and status != 101:
                    continue  # interim responses are dropped (we never send Expect)
                break
            headers = _parse_header_lines(head_lines[1:])
            te = _get(headers, "transfer-encoding")
            cl = _get(headers, "content-length")
            no_body = req.method == "HEAD" or status in (204, 304)
            close_delimited = not no_body and cl is None and not (te and "chunked" in te.lower())
            out_lines = [head_lines[0]]
            for k, v in headers:
                if k.lower() in ("connection", "keep-alive"):
                    continue
                out_lines.append(f"{k}: {v}")
            if close_delimited:
                out_lines.append("Connection: close")
            head = ("\r\n".join(out_lines) + "\r\n\r\n").encode("latin-1")
            if writer is not None:
                writer.write(head)
            throttle = None
            if writer is not None and self.throttle_bps:
                path = req.target.split("?", 1)[0]
                if self._throttle_path is None or self._throttle_path.search(path):
                    throttle = self
            if no_body:
                pass
            elif te and "chunked" in te.lower():
                await _relay_chunked(up_reader, writer, throttle)
            elif cl is not None:
                await _relay_exact(up_reader, writer, int(cl), throttle)
            else:
                await _relay_until_eof(up_reader, writer, throttle)
            if writer is not None:
                await writer.drain()
            return status, not close_delimited
        finally:
            up_writer.close()
            try:
                await asyncio.wait_for(up_writer.wait_closed(), 1)
            except Exception:
                pass


# ── HTTP/1.1 framing helpers ────────────────────────────────────────────────────────────────


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), not a polite FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _write_simple(writer: asyncio.StreamWriter, status: int, extra: list[tuple[str, str]], close: bool) -> None:
    body = (
        '{"detail": "fault injected by tests/faultproxy.py: %d %s"}' % (status, _STATUS_TEXT.get(status, ""))
    ).encode()
    lines = [f"HTTP/1.1 {status} {_STATUS_TEXT.get(status, 'Error')}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in extra]
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        data = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise ProxyProtocolError("connection closed inside a message head") from exc
    except asyncio.LimitOverrunError as exc:
        raise ProxyProtocolError("message head too large") from exc
    if len(data) > _MAX_HEAD_BYTES:
        raise ProxyProtocolError("message head too large")
    return data


def _parse_header_lines(lines: list[str]) -> list[tuple[str, str]]:
    out = []
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ProxyProtocolError(f"bad header line {line!r}")
        out.append((name.strip(), value.strip()))
    return out


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    raw = await _read_head(reader)
    if raw is None:
        return None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ProxyProtocolError(f"bad request line {lines[0]!r}")
    method, target, version = parts
    headers = _parse_header_lines(lines[1:])
    te = _get(headers, "transfer-encoding")
    cl = _get(headers, "content-length")
    if te and "chunked" in te.lower():
        body = await _read_chunked_raw(reader)
    elif cl is not None:
        body = await reader.readexactly(int(cl))
    else:
        body = b""
    return _Request(method, target, version, headers, body)


async def _read_response_head(reader: asyncio.StreamReader) -> tuple[int, list[str]]:
    raw = await _read_head(reader)
    if raw is None:
        raise ProxyProtocolError("upstream closed without a response")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ProxyProtocolError(f"bad status line {lines[0]!r}")
    lines[0] = f"HTTP/1.1 {parts[1]} {parts[2] if len(parts) > 2 else ''}".rstrip()
    return int(parts[1]), [line for line in lines if line != ""]


async def _read_chunked_raw(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        out += size_line
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:  # trailers, then the blank line
                line = await reader.readuntil(b"\r\n")
                out += line
                if line == b"\r\n":
                    return bytes(out)
        out += await reader.readexactly(size + 2)


def _dechunk(raw: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";", 1)[0].strip(), 16)
        pos = eol + 2
        if size == 0:
            return bytes(out)
        out += raw[pos:pos + size]
        pos += size + 2


def _count_paced(throttle, nbytes: int) -> float:
    """Books `nbytes` as paced and returns the pause they cost (0 when not throttled).

    Booked before the bytes are written: a client that has read the last chunk may look at the
    counters before the relay resumes from its drain."""
    bps = getattr(throttle, "throttle_bps", None) if throttle is not None else None
    if not bps:
        return 0.0
    throttle.throttled_bytes += nbytes
    throttle.throttled_s += nbytes / bps
    return nbytes / bps


def _chunk_size(throttle) -> int:
    bps = getattr(throttle, "throttle_bps", None) if throttle is not None else None
    # ~20 writes a second on a throttled link, so the pace is smooth.
    return max(256, min(_COPY_CHUNK, int(bps / 20))) if bps else _COPY_CHUNK


async def _relay_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, n: int,
                       throttle=None) -> None:
    while n > 0:
        chunk = await reader.read(min(n, _chunk_size(throttle)))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(chunk)
        if writer is not None:
            pause = _count_paced(throttle, len(chunk))
            writer.write(chunk)
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)


async def _relay_until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                           throttle=None) -> None:
    while True:
        chunk = await reader.read(_chunk_size(throttle))
        if not chunk:
            return
        if writer is not None:
            pause = _count_paced(throttle, len(chunk))
            writer.write(chunk)
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)


async def _relay_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                         throttle=None) -> None:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        if writer is not None:
            writer.write(size_line)
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:
                line = await reader.readuntil(b"\r\n")
                if writer is not None:
                    writer.write(line)
                if line == b"\r\n":
                    if writer is not None:
                        await writer.drain()
                    return
        await _relay_exact(reader, writer, size + 2, throttle)


__all__ = ["BODY_FAULTS", "DEFAULT_MIX", "FAULT_KINDS", "Event", "FaultProxy"]
