"""A real HTTP server on 127.0.0.1 that answers with scripted failures.

Runs ``http.server.ThreadingHTTPServer`` (HTTP/1.1, keep-alive) in a daemon thread. Each test
scripts what a route answers::

    srv.script("GET", "/v1/loops/runs/r1", Reply(503), Reply(200, {"run": {...}}))
    srv.route("POST", "/trainer/*", handler)          # handler(Request) -> Reply

Scripted replies are used first (in order); then the route's handler; then 404. Every request
is recorded in ``srv.requests`` (method, path, query, headers, JSON body). A ``Reply`` can delay
(a slow server), or ``reset`` the connection (RST, no response) - failures a mock cannot fake.
"""

from __future__ import annotations

import fnmatch
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    delay: float = 0.0
    reset: bool = False  # close the socket with RST instead of answering


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


Handler = Callable[[Request], Reply]


class FaultServer:
    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._scripts: list[tuple[str, str, list[Reply]]] = []
        self._routes: list[tuple[str, str, Handler]] = []
        self._lock = threading.Lock()
        server = self

        class _H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                req = Request(
                    self.command,
                    parts.path,
                    parse_qs(parts.query),
                    {k.lower(): v for k, v in self.headers.items()},
                    raw,
                )
                reply = server._dispatch(req)
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.reset:
                    # SO_LINGER 0 → close() sends RST: the client sees "connection reset".
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                data = reply.body if reply.body is not None else (b"" if reply.json is None else json.dumps(reply.json).encode())
                try:
                    self.send_response(reply.status)
                    if reply.json is not None and reply.body is None:
                        self.send_header("Content-Type", "application/json")
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    self.close_connection = True

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _H)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    # -- scripting -----------------------------------------------------------------------

    def script(self, method: str, path: str, *replies: Reply) -> None:
        """Answer the next requests matching ``method path`` (glob) with ``replies`` in order."""
        with self._lock:
            self._scripts.append((method.upper(), path, list(replies)))

    def route(self, method: str, path: str, handler: Handler) -> None:
        with self._lock:
            self._routes.append((method.upper(), path, handler))

    def _dispatch(self, req: Request) -> Reply:
        with self._lock:
            self.requests.append(req)
            for method, pattern, replies in self._scripts:
                if replies and method == req.method and fnmatch.fnmatchcase(req.path, pattern):
                    return replies.pop(0)
            routes = list(self._routes)
        for method, pattern, handler in routes:
            if method == req.method and fnmatch.fnmatchcase(req.path, pattern):
                return handler(req)
        return Reply(404, {"detail": f"no route for {req.method} {req.path}"})

    def requests_to(self, method: str, path: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == method.upper() and fnmatch.fnmatchcase(r.path, path)]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class FakeTrainer:
    """A trainer worker speaking §3.1 on a FaultServer under ``prefix``.

    Submits: 202 ``{operation_id: <Idempotency-Key>}``; a repeated key is deduped (the op is
    applied once). Polls: ``pending_polls`` answers of 408, then 200 done with ``results[op]``.
    ``applied`` lists (op, seq_id, key) in the order the server applied them.
    """

    def __init__(self, server: FaultServer, prefix: str = "/trainer", pending_polls: int = 1):
        self.server = server
        self.prefix = prefix
        self.pending_polls = pending_polls
        self.applied: list[tuple[str, int, str]] = []
        self.ops: dict[str, dict] = {}  # key -> {op, body, polls}
        self.results: dict[str, Any] = {}
        self.errors: dict[str, tuple[str, str]] = {}  # op -> (error, error_class)
        self.policy_version = 0
        self.lock = threading.Lock()
        server.route("POST", f"{prefix}/*", self._submit)
        server.route("GET", f"{prefix}/operations/*", self._poll)
        server.route("GET", f"{prefix}/health", lambda r: Reply(200, {"status": "ok"}))
        server.route("GET", f"{prefix}/policy_version", lambda r: Reply(200, {"policy_version": self.policy_version}))

    @property
    def distinct_keys(self) -> set[str]:
        return {r.header("idempotency-key") for r in self.server.requests if r.method == "POST" and r.header("idempotency-key")}

    def forget(self) -> None:
        """Simulate a restart that lost every operation record (polls then answer 404)."""
        with self.lock:
            self.ops.clear()

    def _submit(self, req: Request) -> Reply:
        op = req.path[len(self.prefix) + 1 :]
        key = req.header("idempotency-key") or ""
        body = req.json or {}
        with self.lock:
            if key not in self.ops:
                if not any(k == key for _, _, k in self.applied):
                    self.applied.append((op, body.get("seq_id"), key))
                    if op == "optim_step":
                        self.policy_version += 1
                self.ops[key] = {"op": op, "body": body, "polls": 0}
        return Reply(202, {"operation_id": key, "schema_version": 1}, headers={"Location": f"/operations/{key}"})

    def _poll(self, req: Request) -> Reply:
        key = req.path.rsplit("/", 1)[-1]
        with self.lock:
            rec = self.ops.get(key)
            if rec is None:
                return Reply(404, {"detail": "unknown operation"})
            rec["polls"] += 1
            if rec["polls"] <= self.pending_polls:
                return Reply(408, {"status": "pending"})
            op = rec["op"]
        if op in self.errors:
            err, cls = self.errors[op]
            return Reply(200, {"status": "error", "error": err, "error_class": cls})
        result = self.results.get(op, {"op": op, "seq_id": rec["body"].get("seq_id")})
        return Reply(200, {"status": "done", "result": result})
