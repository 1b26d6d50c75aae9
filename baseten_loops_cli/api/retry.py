"""The one retry policy and the one decision over it: pure, no I/O (api/http.py sends).

:func:`decide` takes an outcome (a response or a transport exception) and the state of a
request's attempts, and says retry (after how long), return or raise. Time and randomness come
in as arguments, so the whole table of cases is tested without a server (tests/test_transport.py).
Downloads feed it their own outcomes (api/download.py); everything else is sent through
:meth:`~baseten_loops_cli.api.http.HttpClient.send` / ``asend``.

What :func:`decide` retries:

* transport failures (:data:`RETRYABLE_TRANSPORT_ERRORS`): always when the request was certainly
  not sent (connect errors), otherwise only when the request is *repeatable* (an idempotent
  method, or a body keyed by an ``Idempotency-Key``);
* 429, and 503 with ``Retry-After``: the server refused before doing anything, any request;
* the policy's other statuses (408, 500, 502, 503, 504 by default): repeatable requests only.
  For a request that is not repeatable these are *ambiguous* (the server may have applied it
  before the gateway failed): the error is raised with ``maybe_applied = True`` and
  :meth:`HttpClient.create` reconciles instead of re-sending;
* a wait is the response's ``Retry-After`` (``retry-after-ms``, seconds or an HTTP date), capped
  at ``max_retry_after``, else full-jitter exponential backoff; never past the deadline. A
  transport failure (a reset, a lost response, a refused connection) or a 408 is resent at
  once unless the attempt before failed the same way: one of these says one connection
  failed, not that the server is overloaded (a keyed request that was applied is answered from
  the server's idempotency record, so the resend costs it nothing), and backing off would only
  add the wait to every blip. Two in a row back off, and so does any 5xx without Retry-After
  (the server or its gateway is struggling). The backoff's exponent counts the backoff waits
  taken, not the attempts: an immediate resend or a server's Retry-After is not a guess at how
  long the server needs, so it does not double the next one.
"""

from __future__ import annotations

import dataclasses
import email.utils
import math
import random
import time
from dataclasses import dataclass
from datetime import timezone
from typing import Any, Callable, Iterable, Literal, Mapping

import httpx

DEFAULT_MAX_RETRIES = 3
INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
# Bounds the wait a Retry-After can impose between two attempts (the SDK's cap too).
MAX_RETRY_AFTER = 60.0

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


# The one list of transport failures worth another attempt. Connect errors mean the request
# was never sent; the others may come after the server received (and applied) it.
RETRYABLE_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.ReadTimeout,
    httpx.WriteError,
    httpx.WriteTimeout,
    httpx.RemoteProtocolError,
)



def retry_after_seconds(headers: Mapping[str, str], cap: float = MAX_RETRY_AFTER) -> float | None:
    """The wait a response asks for (``retry-after-ms``, ``Retry-After`` seconds or HTTP date),
    clamped to ``[0, cap]``; ``None`` when it names no usable delay."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            value = float(raw_ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return min(max(value, 0.0), cap)
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if parsed.tzinfo is None:  # "-0000" dates parse naive; they are UTC
            parsed = parsed.replace(tzinfo=timezone.utc)
        value = parsed.timestamp() - time.time()
    if not math.isfinite(value):
        return None
    return min(max(value, 0.0), cap)




@dataclass(frozen=True)
class RetryPolicy:
    """What is retried, how long to wait, and when to give up.

    ``max_retries`` counts extra attempts (``None``: no count, only the deadline); ``deadline``
    is seconds from the first attempt (``None``: none). ``unavailable_limit``: consecutive 503s
    without Retry-After tolerated before the worker is taken as shutting down (``None``: a 503
    is an ordinary retryable status). ``unreachable_limit``: seconds of consecutive transport
    failures before giving up, however long the deadline. ``retry_timeouts``: whether a read
    timeout of a repeatable request is retried (not for sampling: a retry restarts generation).
    """

    retry_statuses: frozenset[int] = RETRY_STATUSES
    max_retries: int | None = DEFAULT_MAX_RETRIES
    deadline: float | None = None
    initial_backoff: float = INITIAL_RETRY_DELAY
    max_backoff: float = MAX_RETRY_DELAY
    max_retry_after: float = MAX_RETRY_AFTER
    unavailable_limit: int | None = None
    unreachable_limit: float | None = None
    retry_timeouts: bool = True

    def replace(self, **changes: Any) -> "RetryPolicy":
        return dataclasses.replace(self, **changes)

    def backoff(self, waits: int, rng: Callable[[], float] = random.random) -> float:
        """Full-jitter exponential backoff: uniform in ``[0, min(max_backoff, initial * 2**waits)]``.

        ``waits`` counts the backoff waits already taken (0 for the first). Full jitter (AWS
        architecture blog) spreads a burst of clients better than the Stainless 0.75-1 factor."""
        return min(self.max_backoff, self.initial_backoff * (2 ** min(waits, 30))) * rng()


DEFAULT_POLICY = RetryPolicy()


def backoff_delay(waits: int, *, rng: Callable[[], float] = random.random) -> float:
    """The default policy's backoff after ``waits`` earlier backoff waits."""
    return DEFAULT_POLICY.backoff(waits, rng)


@dataclass(frozen=True)
class RetryState:
    """Where one request stands: retries made, consecutive 503s without Retry-After, since when
    the server has been unreachable, and the last outcome (for the give-up message)."""

    started: float
    attempt: int = 0
    backoffs: int = 0  # backoff waits taken: the exponent of the next
    unavailable: int = 0
    down_since: float | None = None
    last: str = ""


Action = Literal["retry", "return", "raise"]


@dataclass(frozen=True)
class Decision:
    """``retry`` after ``delay`` seconds, ``return`` the response, or ``raise``.

    ``gave_up``: a retryable outcome, but the budget is spent. ``maybe_applied``: the request
    is not repeatable and the outcome does not say whether the server applied it.
    ``shutdown``: more consecutive 503s without Retry-After than the policy tolerates."""

    action: Action
    delay: float = 0.0
    reason: str = ""
    gave_up: bool = False
    maybe_applied: bool = False
    shutdown: bool = False


def request_was_sent(exc: BaseException) -> bool:
    """Whether a transport failure may have come after the server received the request."""
    return not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))


def decide(
    policy: RetryPolicy,
    outcome: httpx.Response | BaseException,
    state: RetryState,
    *,
    now: float,
    repeatable: bool,
    rng: Callable[[], float] = random.random,
    accept: Iterable[int] = (),
    retry_if: Callable[[httpx.Response], bool] | None = None,
) -> tuple[Decision, RetryState]:
    """The one retry decision: what to do after ``outcome`` (a response or a transport
    exception) of attempt ``state.attempt + 1``, and the state for the next attempt.

    ``accept``: statuses the caller handles itself (returned, never retried or raised).
    ``retry_if``: a caller's extra "not ready yet" test (a cold trainer's 404). Pure: time and
    randomness come in as ``now`` and ``rng``.
    """
    delay: float | None = None
    if isinstance(outcome, BaseException):
        reason = type(outcome).__name__
        in_a_row = state.down_since is not None  # the attempt before also failed in transport
        state = dataclasses.replace(
            state, unavailable=0, last=reason, down_since=now if state.down_since is None else state.down_since
        )
        if not isinstance(outcome, RETRYABLE_TRANSPORT_ERRORS):
            return Decision("raise", reason=reason), state
        if request_was_sent(outcome):
            if not repeatable:
                return Decision("raise", reason=reason, maybe_applied=True), state
            if isinstance(outcome, httpx.TimeoutException) and not policy.retry_timeouts:
                return Decision("raise", reason=reason), state
        if policy.unreachable_limit is not None and now - (state.down_since or now) >= policy.unreachable_limit:
            return Decision("raise", reason=reason, gave_up=True), state
        if not in_a_row:
            delay = 0.0  # a dropped connection is retried at once, on a fresh one (see module doc)
    else:
        status = outcome.status_code
        reason = f"HTTP {status}"
        again = state.last == reason  # the attempt before got the same status
        retry_after = retry_after_seconds(outcome.headers, policy.max_retry_after)
        unavailable = state.unavailable + 1 if status == 503 and retry_after is None else 0
        state = dataclasses.replace(state, unavailable=unavailable, down_since=None, last=reason)
        if status in accept:
            return Decision("return", reason=reason), state
        if retry_if is not None and retry_if(outcome):
            pass
        elif status not in policy.retry_statuses:
            return Decision("return" if status < 400 else "raise", reason=reason), state
        elif not (status == 429 or (status == 503 and retry_after is not None)) and not repeatable:
            # Only 429 and 503 + Retry-After say the server did nothing; after any other
            # failure status a request without an Idempotency-Key may have been applied.
            return Decision("raise", reason=reason, maybe_applied=True), state
        if unavailable and policy.unavailable_limit is not None and unavailable > policy.unavailable_limit:
            return Decision("raise", reason=reason, gave_up=True, shutdown=True), state
        delay = retry_after
        if delay is None and status == 408 and not again:
            delay = 0.0  # the server closed an idle or slow request: it did nothing, resend at once
    if policy.max_retries is not None and state.attempt >= policy.max_retries:
        return Decision("raise", reason=reason, gave_up=True), state
    elapsed = now - state.started
    if policy.deadline is not None and elapsed >= policy.deadline:
        return Decision("raise", reason=reason, gave_up=True), state
    backoffs = state.backoffs
    if delay is None:
        delay, backoffs = policy.backoff(backoffs, rng), backoffs + 1
    if policy.deadline is not None:
        delay = min(delay, policy.deadline - elapsed)
    return Decision("retry", delay=max(delay, 0.0), reason=reason), dataclasses.replace(
        state, attempt=state.attempt + 1, backoffs=backoffs)
