"""Client of a run's trainer worker: the async-op protocol of §3.1.

Every op is ``POST {base_url}/{op}`` with an ``Idempotency-Key`` and a JSON body carrying
``model``, ``run_id`` and ``seq_id``; the trainer answers ``202 {operation_id, schema_version: 1}``
and the result is long-polled from ``GET {base_url}/operations/{id}`` (the server holds ~30 s and
answers 408 while the op is pending).

Guarantees:

* **Order.** ``seq_id`` is assigned and the POST sent under one lock, so the server receives ops
  in ``seq_id`` order even when several threads submit at once (the SDK's "turn gate").
* **At most once.** A submit retried after a dropped connection / 5xx reuses its
  ``Idempotency-Key``, and a poll that gets 404 (server restarted, result evicted) resubmits
  once with the same key and body, so the server dedupes instead of applying the op twice.
* **Pipelining.** Submits are eager and results lazy: ``fb = tc.forward_backward(...);
  opt = tc.optim_step(...); fb.result(); opt.result()`` has both ops queued server-side.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from typing import Any, Callable, Generic, Iterable, Mapping, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from baseten_loops_cli.api.errors import (
    ApiError,
    OperationExpiredError,
    OperationTimeoutError,
    PolicyVersionUnavailableError,
    ProtocolError,
    RemoteOpError,
    ServerShutdownError,
    UnknownOperationError,
)
from baseten_loops_cli.api.http import (
    USER_AGENT,
    auth_headers,
    backoff_delay,
    connection_error,
    error_from_response,
    get_with_retries,
    is_permanent_rejection,
    retry_after_seconds,
)
from baseten_loops_cli.workers.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    InitTrainerServerResponse,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

T = TypeVar("T", bound=BaseModel)

RUN_ID_HEADER = "X-Run-Id"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
ACCEPTANCE_SCHEMA_VERSION = 1

# Total budget for retrying a submit (cold start, 502s) and for polling one op; the SDK's
# ``ready_timeout`` defaults (600 s for a directly-built client, 3600 s for polls).
DEFAULT_SUBMIT_TIMEOUT = 600.0
DEFAULT_UNREACHABLE_TIMEOUT = 45.0  # seconds of consecutive transport errors
DEFAULT_RESULT_TIMEOUT = 3600.0
# Pause before re-polling after a 502/504 or a lost poll response (SDK: 2 s).
POLL_BACKOFF = 2.0
SUBMIT_INITIAL_BACKOFF = 0.25
SUBMIT_MAX_BACKOFF = 10.0

# Transport errors after which a request is simply sent again (keys make submits safe).
_RETRYABLE_TRANSPORT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.ReadTimeout,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    httpx.PoolTimeout,
)
# Statuses a submit retries with backoff (408 = gateway/queue timeout; 5xx from proxies).
_SUBMIT_RETRY_STATUSES = frozenset({408, 500, 502, 504})
# Statuses that mean "not ready yet" only while the trainer has never accepted an op
# (a cold dedicated trainer behind its proxy answers 400/404 until it is up).
_COLD_START_STATUSES = frozenset({400, 404})


def _jsonable_data(data: Iterable[Datum | Mapping[str, Any]]) -> list[dict]:
    return [d.model_dump(mode="json") if isinstance(d, BaseModel) else dict(d) for d in data]


def _loss_body(data: Iterable[Datum | Mapping[str, Any]], loss_fn: str, loss_fn_config: dict | None,
               top_k_logprobs: int) -> dict:
    """The body shared by ``/forward`` and ``/forward_backward``."""
    return {
        "data": _jsonable_data(data),
        "loss_fn": loss_fn,
        "loss_fn_config": loss_fn_config,
        "top_k_logprobs": int(top_k_logprobs),
    }


class _Submission:
    """What is needed to (re)send one op: path, full body and its idempotency key."""

    __slots__ = ("op", "body", "key", "seq_id")

    def __init__(self, op: str, body: dict, key: str, seq_id: int):
        self.op = op
        self.body = body
        self.key = key
        self.seq_id = seq_id


class OpFuture(Generic[T]):
    """Handle to one submitted trainer op.

    ``result(timeout=None)`` long-polls until the op finishes and returns the result as a JSON
    dict (``parsed()`` returns it validated into the op's pydantic type). Results and errors are
    cached: calling again does not re-poll. Thread-safe; ``await fut`` works too.
    """

    def __init__(self, client: "TrainerClient", submission: _Submission, operation_id: str, result_type: type[T]):
        self._client = client
        self._submission = submission
        self._operation_id = operation_id
        self.result_type = result_type
        self._lock = threading.Lock()
        self._result: dict | None = None
        self._exc: BaseException | None = None
        self._resubmitted = False

    @property
    def operation_id(self) -> str:
        return self._operation_id

    @property
    def op(self) -> str:
        return self._submission.op

    @property
    def seq_id(self) -> int:
        return self._submission.seq_id

    @property
    def idempotency_key(self) -> str:
        return self._submission.key

    def done(self) -> bool:
        """Whether a result or error is cached (no network call)."""
        return self._result is not None or self._exc is not None

    def result(self, timeout: float | None = None) -> dict:
        """Block until the op finishes; raises :class:`RemoteOpError` if it failed on the server,
        :class:`OperationTimeoutError` when ``timeout`` (default: the client's
        ``result_timeout``) runs out - the op itself keeps running and a later call polls again."""
        with self._lock:
            if self._exc is not None:
                raise self._exc
            if self._result is not None:
                return self._result
            try:
                self._result = self._poll(self._client.result_timeout if timeout is None else timeout)
                return self._result
            except OperationTimeoutError:
                raise  # not cached: the op may still finish
            except BaseException as exc:
                self._exc = exc
                raise

    def parsed(self, timeout: float | None = None) -> T:
        """:meth:`result` validated into the op's result type (e.g. ``ForwardBackwardOutput``)."""
        return self.result_type.model_validate(self.result(timeout))

    def __await__(self):
        return asyncio.to_thread(self.result).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<OpFuture {self.op} seq={self.seq_id} id={self._operation_id} {state}>"

    # -- polling -------------------------------------------------------------------------

    def _poll(self, budget: float) -> dict:
        c = self._client
        deadline = time.monotonic() + budget
        unavailable = 0  # consecutive 503s without Retry-After
        down_since: float | None = None  # start of the current run of transport errors
        failures = 0  # consecutive failed polls (transport errors, 502/504)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise OperationTimeoutError(
                    f"{self.op} {self._operation_id} did not finish within {budget:g}s (it may still be running)"
                )
            url = f"{c.base_url}/operations/{quote(self._operation_id, safe='')}"
            # Read timeout just above the server's hold, so an idle poll gets the server's 408.
            read_timeout = min(c.poll_hold_timeout, max(remaining, 0.05))
            try:
                resp = c._http.get(url, timeout=httpx.Timeout(read_timeout, connect=min(10.0, read_timeout)))
            except httpx.ReadTimeout:
                if read_timeout < c.poll_hold_timeout:
                    continue  # our own budget cut the hold short; the loop head raises
                failures += 1
                c._sleep(min(c._poll_retry_delay(failures), max(deadline - time.monotonic(), 0)))
                continue
            except _RETRYABLE_TRANSPORT as exc:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > c.unreachable_timeout:
                    raise connection_error(exc, url, api_key=c._api_key) from exc
                failures += 1
                c._sleep(min(c._poll_retry_delay(failures), max(deadline - time.monotonic(), 0)))
                continue

            down_since = None
            status = resp.status_code
            unavailable = unavailable + 1 if status == 503 else 0
            if status not in (502, 504):
                failures = 0
            if status == 408:
                continue  # the normal "still pending": re-poll at once, no backoff
            if status == 200:
                body = _json(resp)
                state = body.get("status") if isinstance(body, dict) else None
                if state == "done":
                    result = body.get("result")
                    return result if isinstance(result, dict) else {"value": result}
                if state == "error":
                    raise RemoteOpError(
                        str(body.get("error") or "unknown error"),
                        error_class=body.get("error_class"),
                        operation=self.op,
                        operation_id=self._operation_id,
                        run_id=c.run_id,
                    )
                # "pending"/"running" from a server that answers at once instead of holding.
                c._sleep(min(0.5, max(deadline - time.monotonic(), 0)))
                continue
            if status == 404:
                if self._resubmitted:
                    raise UnknownOperationError(
                        f"the trainer has no record of {self.op} {self._operation_id} even after resubmitting it",
                        hint="the trainer may have restarted; re-run the step",
                    )
                # Unknown id (restart) or evicted result: resubmit with the SAME key and body,
                # so a server that did run it dedupes, and one that did not runs it now.
                self._resubmitted = True
                self._operation_id = c._send_submission(self._submission)
                continue
            if status == 410:
                raise OperationExpiredError(f"the result of {self.op} {self._operation_id} expired on the trainer")
            if status == 503:
                delay = retry_after_seconds(resp.headers)
                if delay is None:
                    # The SDK treats this as shutdown at once; a proxy in front of the trainer
                    # also answers 503 for a moment, so tolerate a few in a row first.
                    if unavailable > c.max_unavailable_retries:
                        raise ServerShutdownError(url=c.base_url)
                    delay = c._backoff_delay(unavailable - 1)
                c._sleep(min(delay, max(deadline - time.monotonic(), 0)))
                continue
            if status in (502, 504):
                failures += 1
                c._sleep(min(c._poll_retry_delay(failures), max(deadline - time.monotonic(), 0)))
                continue
            raise error_from_response(resp, api_key=c._api_key)


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


class TrainerClient:
    """Client of one run's trainer worker (``run.base_url``). Thread-safe; one per run."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        run_id: str | None,
        base_model: str,
        http: httpx.Client | None = None,
        poll_hold_timeout: float = 35.0,
        timeout: float = 60.0,
        submit_timeout: float = DEFAULT_SUBMIT_TIMEOUT,
        result_timeout: float = DEFAULT_RESULT_TIMEOUT,
        poll_backoff: float = POLL_BACKOFF,
        max_unavailable_retries: int = 6,
        unreachable_timeout: float = DEFAULT_UNREACHABLE_TIMEOUT,
        get_retries: int = 8,
        user_agent: str = USER_AGENT,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
    ):
        self.base_url = base_url.rstrip("/")
        self.run_id = run_id
        self.base_model = base_model
        self.poll_hold_timeout = poll_hold_timeout
        self.submit_timeout = submit_timeout
        self.result_timeout = result_timeout
        self.poll_backoff = poll_backoff
        # Consecutive 503s without Retry-After tolerated (with backoff) before ServerShutdownError.
        self.max_unavailable_retries = max_unavailable_retries
        # How long the trainer may be unreachable (connection refused, resets) before an op
        # fails: a dead server should end a run with a clear message, not an hour of retries.
        self.unreachable_timeout = unreachable_timeout
        # Retries of the plain GETs (health, policy_version) on transport errors / 5xx / 408.
        self.get_retries = get_retries
        self._api_key = api_key
        self._sleep = sleep
        self._rng = rng
        headers = auth_headers(api_key, user_agent)
        if run_id:
            headers[RUN_ID_HEADER] = run_id  # the serverless gateway needs it on every request
        self._owns_http = http is None
        if http is None:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
            http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)
        else:
            http.headers.update(headers)
        self._http = http
        # Held across seq_id assignment AND the POST: submit order == seq order on the wire.
        self._submit_lock = threading.Lock()
        self._next_seq = 1
        # Set after the first accepted op: from then on 400/404 are real errors, not cold start.
        self._warm = False

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> "TrainerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain routes ----------------------------------------------------------------------

    def health(self) -> dict:
        """``GET /health?base_model=...``; returns the JSON body, raises a typed error if not 2xx."""
        url = f"{self.base_url}/health"
        resp = get_with_retries(self._http, url, params={"base_model": self.base_model}, max_retries=self.get_retries,
                                sleep=self._sleep, rng=self._rng, api_key=self._api_key)  # fmt: skip
        if resp.status_code >= 400:
            raise error_from_response(resp, api_key=self._api_key)
        body = _json(resp)
        return body if isinstance(body, dict) else {}

    def policy_version(self) -> int:
        """``GET /policy_version`` = number of optim steps applied so far."""
        url = f"{self.base_url}/policy_version"
        resp = get_with_retries(self._http, url, max_retries=self.get_retries, sleep=self._sleep, rng=self._rng,
                                api_key=self._api_key)  # fmt: skip
        if resp.status_code == 501:
            raise PolicyVersionUnavailableError(
                "this trainer does not expose its policy version (serverless trainer)",
                hint="use the version returned by save_weights_for_sampler",
            )
        if resp.status_code >= 400:
            raise error_from_response(resp, api_key=self._api_key)
        body = _json(resp)
        try:
            return int(body["policy_version"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ProtocolError(f"unexpected /policy_version body: {str(body)[:200]}") from exc

    # -- ops -------------------------------------------------------------------------------

    def forward_backward(
        self,
        data: Iterable[Datum | Mapping[str, Any]],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
        top_k_logprobs: int = 0,
    ) -> OpFuture[ForwardBackwardOutput]:
        body = _loss_body(data, loss_fn, loss_fn_config, top_k_logprobs)
        return self._submit("forward_backward", body, ForwardBackwardOutput)

    def forward(
        self,
        data: Iterable[Datum | Mapping[str, Any]],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
        top_k_logprobs: int = 0,
    ) -> OpFuture[ForwardBackwardOutput]:
        """Like :meth:`forward_backward` without gradients (safe during accumulation)."""
        body = _loss_body(data, loss_fn, loss_fn_config, top_k_logprobs)
        return self._submit("forward", body, ForwardBackwardOutput)

    def optim_step(self, adam_params: AdamParams | Mapping[str, Any] | None = None) -> OpFuture[OptimStepResponse]:
        params = adam_params if isinstance(adam_params, AdamParams) else AdamParams.model_validate(adam_params or {})
        return self._submit("optim_step", {"adam_params": params.model_dump(mode="json")}, OptimStepResponse)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> OpFuture[SaveWeightsResponse]:
        """Save full training state (weights + optimizer) as ``bt://loops:<run>/weights/<name>``."""
        return self._submit("save_state", {"name": name, "ttl_seconds": ttl_seconds}, SaveWeightsResponse)

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None, bump_version: bool = False
    ) -> OpFuture[SaveWeightsForSamplerResponse]:
        """Publish the adapter for sampling as ``bt://loops:<run>/sampler_weights/<name>``."""
        body = {"name": name, "ttl_seconds": ttl_seconds, "bump_version": bool(bump_version)}
        return self._submit("save_weights_for_sampler", body, SaveWeightsForSamplerResponse)

    def load_state(self, path: str, with_optimizer: bool = False) -> OpFuture[LoadWeightsResponse]:
        """Load a trainer checkpoint; ``with_optimizer`` also restores optimizer state and step."""
        op = "load_state_with_optimizer" if with_optimizer else "load_state"
        return self._submit(op, {"path": path}, LoadWeightsResponse)

    def load_state_with_optimizer(self, path: str) -> OpFuture[LoadWeightsResponse]:
        return self.load_state(path, with_optimizer=True)

    def init_trainer_server(self, lora_rank: int) -> OpFuture[InitTrainerServerResponse]:
        body = {"lora_rank": int(lora_rank), "base_model": self.base_model}
        return self._submit("init_trainer_server", body, InitTrainerServerResponse)

    # -- submit machinery ------------------------------------------------------------------

    def _submit(self, op: str, body: dict, result_type: type[T]) -> OpFuture[T]:
        with self._submit_lock:
            seq_id = self._next_seq
            self._next_seq += 1
            full = {**body, "model": self.base_model, "run_id": self.run_id, "seq_id": seq_id}
            submission = _Submission(op, full, uuid.uuid4().hex, seq_id)
            operation_id = self._send_submission(submission)
        return OpFuture(self, submission, operation_id, result_type)

    def _send_submission(self, sub: _Submission) -> str:
        """POST one op (retrying with the same Idempotency-Key) and return its operation_id."""
        url = f"{self.base_url}/{sub.op}"
        headers = {IDEMPOTENCY_KEY_HEADER: sub.key}
        deadline = time.monotonic() + self.submit_timeout
        attempt = 0
        unavailable = 0  # consecutive 503s without Retry-After
        down_since: float | None = None  # start of the current run of transport errors
        while True:
            try:
                resp = self._http.post(url, json=sub.body, headers=headers)
            except _RETRYABLE_TRANSPORT as exc:
                down_since = down_since or time.monotonic()
                if time.monotonic() >= deadline or time.monotonic() - down_since > self.unreachable_timeout:
                    raise connection_error(exc, url, api_key=self._api_key) from exc
                self._backoff(attempt, deadline)
                attempt += 1
                continue
            except httpx.TransportError as exc:
                raise connection_error(exc, url, api_key=self._api_key) from exc

            down_since = None
            status = resp.status_code
            if 200 <= status < 300:
                self._warm = True
                return self._operation_id(resp, sub)
            retry_after = retry_after_seconds(resp.headers)
            retryable = (
                status in _SUBMIT_RETRY_STATUSES
                or (status in (429, 503) and retry_after is not None)
                or (status in _COLD_START_STATUSES and not self._warm and not is_permanent_rejection(resp))
            )
            if status == 503 and retry_after is None:
                unavailable += 1
                if unavailable > self.max_unavailable_retries:
                    raise ServerShutdownError(url=self.base_url)
                retryable = True  # a few in a row are a proxy blip, not a shutdown
            else:
                unavailable = 0
            if retryable and time.monotonic() < deadline:
                if retry_after is not None:
                    self._sleep(min(retry_after, max(deadline - time.monotonic(), 0)))
                else:
                    self._backoff(attempt, deadline)
                attempt += 1
                continue
            raise error_from_response(resp, api_key=self._api_key)

    def _operation_id(self, resp: httpx.Response, sub: _Submission) -> str:
        body = _json(resp)
        op_id = body.get("operation_id") if isinstance(body, dict) else None
        version = body.get("schema_version", ACCEPTANCE_SCHEMA_VERSION) if isinstance(body, dict) else None
        if not isinstance(op_id, str) or not op_id or version != ACCEPTANCE_SCHEMA_VERSION:
            raise ProtocolError(
                f"{sub.op}: unsupported operation acceptance (HTTP {resp.status_code}): {str(body)[:200]}",
                hint="the trainer speaks a different protocol version than this client",
            )
        return op_id

    def _poll_retry_delay(self, failures: int) -> float:
        """A failed poll is retried quickly at first (a blip costs ~0.25 s, not the SDK's flat
        2 s), backing off to ``poll_backoff`` while the failures continue."""
        return backoff_delay(failures - 1, initial=0.25, maximum=self.poll_backoff, rng=self._rng)

    def _backoff_delay(self, attempt: int) -> float:
        return backoff_delay(attempt, initial=SUBMIT_INITIAL_BACKOFF, maximum=SUBMIT_MAX_BACKOFF, rng=self._rng)

    def _backoff(self, attempt: int, deadline: float) -> None:
        self._sleep(min(self._backoff_delay(attempt), max(deadline - time.monotonic(), 0)))


__all__ = ["OpFuture", "TrainerClient", "RemoteOpError", "ServerShutdownError", "ApiError"]
