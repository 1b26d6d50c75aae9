"""What the trainer and sampler clients share: one constructor, one transport, one long-poll.

A worker client is an :class:`~baseten_loops_cli.api.http.HttpClient` on the worker's base URL
(sharing the process's httpx client of that origin with the control plane), its retry
policies, the helpers to read JSON answers, and :meth:`WorkerClient._await_operation`, the
``GET /operations/{id}`` long-poll of a trainer op and of a queued (202) sample. Subclasses
add their routes.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Iterable, Mapping, TypedDict
from urllib.parse import quote

import httpx

from baseten_loops_cli.api.errors import (
    ApiError,
    OperationExpiredError,
    OperationTimeoutError,
    ProtocolError,
    RemoteOpError,
    RequestTimeoutError,
)
from baseten_loops_cli.api.http import USER_AGENT, HttpClient
from baseten_loops_cli.api.retry import RetryPolicy
from baseten_loops_cli.api.polling import Clock, Poll, Sleep

# Retries of plain GETs (health, policy version, model list) on transport errors / 5xx / 408.
DEFAULT_GET_RETRIES = 8
# How long a worker holds a GET /operations/{id} before answering 408 ("still pending") is
# ~30 s; a poll's read timeout is just above it, so an idle poll gets the 408, not a timeout.
DEFAULT_POLL_HOLD_TIMEOUT = 35.0
# The pause between polls of a server that answers "pending" at once instead of holding.
OPERATION_POLL_INTERVAL = 0.5


class WorkerOptions(TypedDict, total=False):
    """The keywords every worker client passes on to :class:`WorkerClient` as they are (its
    defaults stand for those left out)."""

    get_retries: int
    user_agent: str
    sleep: Sleep
    clock: Clock
    rng: Callable[[], float]
    transport: httpx.BaseTransport | None


class WorkerClient:
    """Base of :class:`TrainerClient` and :class:`SamplerClient`.

    ``timeout``: read timeout of one request (connect: 10 s). ``headers``: sent with every
    request (a trainer's ``X-Run-Id``). ``sleep`` / ``rng`` make retry waits testable, and
    ``sleep`` / ``clock`` the polls (:class:`~baseten_loops_cli.api.polling.Poll`);
    ``transport`` (tests) replaces the network.
    """

    poll_hold_timeout = DEFAULT_POLL_HOLD_TIMEOUT

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        run_id: str | None = None,
        timeout: float = 60.0,
        headers: Mapping[str, str] | None = None,
        get_retries: int = DEFAULT_GET_RETRIES,
        user_agent: str = USER_AGENT,
        sleep: Sleep = time.sleep,
        clock: Clock = time.monotonic,
        rng: Callable[[], float] = random.random,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.run_id = run_id
        self._api_key = api_key
        self._sleep = sleep
        self._clock = clock
        self._rng = rng
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._get_policy = RetryPolicy(max_retries=get_retries)
        self._http = HttpClient(self.base_url, api_key, timeout=self._timeout, policy=self._get_policy,
                                user_agent=user_agent, headers=headers, sleep=sleep, rng=rng, transport=transport)  # fmt: skip

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    async def aclose(self) -> None:
        await self._http.aclose()
        self.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- helpers ---------------------------------------------------------------------------

    def _get_json(self, path: str, *, params: Mapping[str, Any] | None = None,
                  headers: Mapping[str, str] | None = None, accept: Iterable[int] = ()) -> tuple[int, Any]:
        """GET ``path`` (retried by the GET policy); ``(status, JSON body or None)``."""
        resp = self._http.send("GET", path, params=params, headers=headers, accept=accept)
        return resp.status_code, json_body(resp)

    def _poll(self, *, timeout: float | None, interval: float = OPERATION_POLL_INTERVAL) -> Poll:
        """A :class:`Poll` on this client's sleep and clock (by default, an operation's)."""
        return Poll(interval=interval, timeout=timeout, sleep=self._sleep, clock=self._clock)

    def _await_operation(
        self,
        operation_id: str,
        *,
        operation: str,
        poll: Poll,  # self._poll(timeout=...)
        policy: RetryPolicy,
        headers: Mapping[str, str] | None = None,
        resubmit: Callable[[], str] | None = None,
    ) -> dict:
        """Long-poll ``GET operations/{operation_id}`` until the op is done; its result.

        The worker holds each poll up to ~30 s and answers 408 while the op is pending: polled
        again at once. A "pending"/"running" body (a server that does not hold) is polled again
        after ``poll.interval`` (:data:`OPERATION_POLL_INTERVAL`). 404 (unknown id: a restarted
        worker) calls ``resubmit`` for the id of the op sent again with its Idempotency-Key
        (without it, 404 is the transport's ``NotFoundError``); 410 is
        :class:`OperationExpiredError`; an op that failed is :class:`RemoteOpError`. ``policy`` retries each poll's failures (bounded by
        what is left of ``poll``); when ``poll``'s deadline passes, :class:`OperationTimeoutError`
        (the op itself may still be running).
        """
        accept = {408, 410} | ({404} if resubmit is not None else set())
        last: Exception | None = None
        for _ in poll:
            remaining = max(poll.remaining(), 0.05)
            # Read timeout just above the server's hold, so an idle poll gets the server's 408.
            read_timeout = min(self.poll_hold_timeout, remaining)
            try:
                resp = self._http.send(
                    "GET", f"operations/{quote(str(operation_id), safe='')}", headers=headers,
                    timeout=httpx.Timeout(read_timeout, connect=min(10.0, read_timeout)),
                    policy=policy.replace(deadline=remaining), accept=accept,
                )  # fmt: skip
            except (RequestTimeoutError, ApiError) as exc:
                if not poll.expired:
                    raise
                last = exc
                break
            status = resp.status_code
            if status == 408:
                poll.again()  # the normal "still pending": the server's hold ran out
                continue
            if status == 404 and resubmit is not None:
                # Unknown id (restart) or evicted result: the op sent again with the SAME key
                # and body, so a worker that did run it dedupes, and one that did not runs it now.
                operation_id = resubmit()
                poll.again()
                continue
            if status == 410:
                raise OperationExpiredError(f"the result of {operation} {operation_id} expired on the worker")
            body = json_body(resp)
            state = body.get("status") if isinstance(body, dict) else None
            if state == "done":
                result = body.get("result")
                return result if isinstance(result, dict) else {"value": result}
            if state == "error":
                raise RemoteOpError(
                    str(body.get("error") or "unknown error"),
                    error_class=body.get("error_class"),
                    operation=operation,
                    operation_id=str(operation_id),
                    run_id=self.run_id,
                )
        raise OperationTimeoutError(
            f"{operation} {operation_id} did not finish within {poll.timeout:g}s (it may still be running)"
            + (f"; last answer: {last}" if last is not None else "")
        ) from last


def json_body(resp: httpx.Response) -> Any:
    """The JSON body of a worker answer, or None when it has none (or not JSON)."""
    try:
        return resp.json()
    except ValueError:
        return None


def require_dict(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{what} answered an unexpected body: {str(body)[:200]}")
    return body


__all__ = ["DEFAULT_GET_RETRIES", "DEFAULT_POLL_HOLD_TIMEOUT", "WorkerClient", "WorkerOptions", "json_body", "require_dict"]
