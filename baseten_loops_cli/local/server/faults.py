"""Test-only fault injection (enabled with ``--enable-fault-hooks``).

Lets tests of the *clients* (retry policies, long-poll loops, error rendering) make a
real server misbehave on cue, instead of mocking HTTP:

    POST /v1/local/faults
    {"path": "/trainers/*/forward_backward",   # fnmatch pattern on the URL path
     "method": "POST",                         # optional; any method when omitted
     "times": 2,                               # how many matching requests it hits
     "status": 503,                            # optional; omit to only delay
     "retry_after": 1,                         # optional Retry-After header (seconds)
     "delay_s": 0.5,                           # optional delay before answering/passing on
     "body": {...}}                            # optional JSON body (default: our error shape)
    -> 200 {"fault": {..., "id": "f1", "remaining": 2}}

    GET /v1/local/faults      -> {"faults": [...]}
    DELETE /v1/local/faults   -> {"cleared": n}

A fault can also target the *compute* jobs behind ops and samples, to make an op slow or
fail deterministically (a long-poll that must answer 408, an op in flight at a crash):

    {"job": "forward_backward *",   # fnmatch pattern on the job label "<op> <run_id>"
     "times": 1, "delay_s": 3}      # and/or "error": "message" (the op fails, InjectedFault)

A sample job can also be paused mid-generation, to observe a stream while decoding is
provably not finished (no timing involved):

    {"job": "sample *", "pause_after_tokens": 1}   # a streamed sample stops decoding after
                                                   # 1 token until DELETE /v1/local/faults

Faults apply in the order they were added; a request (or job) consumes at most one. The
fault routes themselves are never faulted. Without the flag none of this exists (404).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import itertools
import threading
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from baseten_loops_cli.local.server.errors import bad_request
from baseten_loops_cli.local.server.schemas import parse_body

FAULTS_PATH = "/v1/local/faults"


class InjectedFault(RuntimeError):
    """Raised inside a compute job by a ``{"job": ..., "error": ...}`` fault."""

    error_class = "InjectedFault"


@dataclasses.dataclass
class Fault:
    id: str
    path: str | None  # HTTP faults
    job: str | None  # compute faults
    method: str | None
    remaining: int
    status: int | None
    retry_after: float | None
    delay_s: float
    body: Any
    error: str | None
    pause_after_tokens: int | None = None

    def matches(self, method: str, path: str) -> bool:
        return (self.path is not None and self.remaining > 0
                and (self.method is None or self.method == method)
                and fnmatch.fnmatchcase(path, self.path))

    def matches_job(self, label: str) -> bool:
        return (self.job is not None and self.remaining > 0
                and fnmatch.fnmatchcase(label, self.job))

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class FaultInjector:
    """Thread-safe: HTTP faults are taken on the event loop, job faults on compute threads."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._released = threading.Event()  # replaced by clear(): resumes paused decoding
        self._paused = threading.local()  # per compute thread: [tokens left, release event]

    def add(self, spec: dict[str, Any]) -> Fault:
        if not isinstance(spec, dict) or not (isinstance(spec.get("path"), str)
                                              or isinstance(spec.get("job"), str)):
            raise bad_request("A fault needs 'path' (an fnmatch pattern such as "
                              "'/trainers/*/forward_backward') or 'job' (e.g. "
                              "'forward_backward *').", "InvalidFault")
        status = spec.get("status")
        delay = float(spec.get("delay_s") or 0)
        error = spec.get("error")
        pause = spec.get("pause_after_tokens")
        if pause is not None and (not isinstance(pause, int) or pause < 1
                                  or spec.get("job") is None):
            raise bad_request("'pause_after_tokens' takes an integer >= 1, on a 'job' fault.",
                              "InvalidFault")
        if spec.get("job") is not None:
            if status is not None or (delay <= 0 and not error and pause is None):
                raise bad_request("A job fault takes 'delay_s' > 0, 'error' (a message) and/or "
                                  "'pause_after_tokens'; HTTP statuses apply to 'path' faults.",
                                  "InvalidFault")
        elif status is None and delay <= 0:
            raise bad_request("A fault needs 'status' (e.g. 503) and/or 'delay_s' > 0.",
                              "InvalidFault")
        if status is not None and not (isinstance(status, int) and 100 <= status <= 599):
            raise bad_request(f"'status' must be an HTTP status code, got {status!r}.",
                              "InvalidFault")
        times = spec.get("times", 1)
        if not isinstance(times, int) or times < 1:
            raise bad_request(f"'times' must be an integer >= 1, got {times!r}.", "InvalidFault")
        method = spec.get("method")
        with self._lock:
            fault = Fault(
                id=f"f{next(self._ids)}", path=spec.get("path"), job=spec.get("job"),
                method=method.upper() if isinstance(method, str) else None,
                remaining=times, status=status, retry_after=spec.get("retry_after"),
                delay_s=delay, body=spec.get("body"), error=error, pause_after_tokens=pause,
            )
            self._faults.append(fault)
        return fault

    def _take(self, matches) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if matches(fault):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def take(self, method: str, path: str) -> Fault | None:
        return self._take(lambda f: f.matches(method, path))

    def before_job(self, label: str) -> None:
        """Called on a compute thread before each job: apply a matching job fault (a delay
        lasts ``delay_s``, or until the faults are cleared)."""
        self._paused.state = None
        fault = self._take(lambda f: f.matches_job(label))
        if fault is None:
            return
        if fault.pause_after_tokens:
            self._paused.state = [fault.pause_after_tokens, self._released]
        if fault.delay_s > 0:
            self._released.wait(fault.delay_s)  # clearing the faults ends the delay early
        if fault.error:
            raise InjectedFault(f"{fault.error} (injected fault {fault.id})")

    def after_token(self) -> None:
        """Called on a compute thread after each streamed token: hold a paused job until
        the faults are cleared (at most a minute, so a forgotten pause cannot hang)."""
        state = getattr(self._paused, "state", None)
        if state is None:
            return
        state[0] -= 1
        if state[0] <= 0:
            self._paused.state = None
            state[1].wait(60)

    def clear(self) -> int:
        with self._lock:
            count = len(self._faults)
            self._faults.clear()
            self._released.set()
            self._released = threading.Event()
        return count

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [f.describe() for f in self._faults]


class FaultMiddleware:
    """Runs after auth, so a faulted request still needs the token."""

    def __init__(self, app: ASGIApp, injector: FaultInjector) -> None:
        self.app = app
        self.injector = injector

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == FAULTS_PATH:
            await self.app(scope, receive, send)
            return
        fault = self.injector.take(scope["method"], scope["path"])
        if fault is None:
            await self.app(scope, receive, send)
            return
        if fault.delay_s > 0:
            await asyncio.sleep(fault.delay_s)
        if fault.status is None:
            await self.app(scope, receive, send)
            return
        headers = {}
        if fault.retry_after is not None:
            headers["Retry-After"] = str(fault.retry_after)
        body = fault.body if fault.body is not None else {
            "detail": f"Injected fault {fault.id} ({fault.status}) for testing.",
            "error_class": "InjectedFault",
        }
        await JSONResponse(body, status_code=fault.status, headers=headers)(scope, receive, send)


async def faults_endpoint(request: Request) -> JSONResponse:
    injector: FaultInjector = request.app.state.faults
    if request.method == "GET":
        return JSONResponse({"faults": injector.list()})
    if request.method == "DELETE":
        return JSONResponse({"cleared": injector.clear()})
    spec = await parse_body(request)
    return JSONResponse({"fault": injector.add(spec).describe()})
