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

import threading
import uuid
from typing import Any, Generic, Iterable, Mapping, NamedTuple, TypeVar, Unpack

import httpx
from pydantic import BaseModel

from baseten_loops_cli.api.errors import (
    ApiError,
    OperationTimeoutError,
    PolicyVersionUnavailableError,
    ProtocolError,
    RemoteOpError,
    ServerShutdownError,
    UnknownOperationError,
)
from baseten_loops_cli.api.http import is_permanent_rejection
from baseten_loops_cli.api.retry import RetryPolicy
from baseten_loops_cli.workers.client import DEFAULT_POLL_HOLD_TIMEOUT, WorkerClient, WorkerOptions, json_body
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
# Statuses that mean "not ready yet" only while the trainer has never accepted an op
# (a cold dedicated trainer behind its proxy answers 400/404 until it is up).
_COLD_START_STATUSES = frozenset({400, 404})


# The examples of /forward and /forward_backward: wire types or their JSON as dicts.
LossData = Iterable[Datum | Mapping[str, Any]]


def _jsonable_data(data: LossData) -> list[dict]:
    return [d.model_dump(mode="json") if isinstance(d, BaseModel) else dict(d) for d in data]


def _loss_body(data: LossData, loss_fn: str, loss_fn_config: dict | None,
               top_k_logprobs: int) -> dict:
    """The body shared by ``/forward`` and ``/forward_backward``."""
    return {
        "data": _jsonable_data(data),
        "loss_fn": loss_fn,
        "loss_fn_config": loss_fn_config,
        "top_k_logprobs": int(top_k_logprobs),
    }


class _Submission(NamedTuple):
    """What is needed to (re)send one op: path, full body and its idempotency key."""

    op: str
    body: dict
    key: str
    seq_id: int


class OpFuture(Generic[T]):
    """Handle to one submitted trainer op.

    ``result(timeout=None)`` long-polls until the op finishes and returns the result as a JSON
    dict (``parsed()`` returns it validated into the op's pydantic type). Results and errors are
    cached: calling again does not re-poll. Thread-safe; ``await fut`` works too.
    """

    def __init__(self, client: "TrainerClient", submission: _Submission, operation_id: str, result_type: type[T]):
        self._client = client
        self._submission = submission
        self.op = submission.op  # the op's route, e.g. "forward_backward"
        self.seq_id = submission.seq_id
        self.idempotency_key = submission.key
        self._operation_id = operation_id
        self.result_type = result_type
        self._lock = threading.Lock()
        self._result: dict | None = None
        self._exc: BaseException | None = None
        self._resubmitted = False

    @property
    def operation_id(self) -> str:
        """The server's id of the op (a new one once the op was resubmitted after a 404)."""
        return self._operation_id

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
                self._result = self._await(self._client.result_timeout if timeout is None else timeout)
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
        import asyncio  # here: a sync training loop never needs it

        return asyncio.to_thread(self.result).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<OpFuture {self.op} seq={self.seq_id} id={self._operation_id} {state}>"

    # -- polling -------------------------------------------------------------------------

    def _await(self, budget: float) -> dict:
        c = self._client
        return c._await_operation(self._operation_id, operation=self.op, poll=c._poll(timeout=budget),
                                  policy=c._poll_policy, resubmit=self._resubmit)  # fmt: skip

    def _resubmit(self) -> str:
        """The op sent again (same key and body) after a poll's 404; once per future."""
        if self._resubmitted:
            raise UnknownOperationError(
                f"the trainer has no record of {self.op} {self._operation_id} even after resubmitting it",
                hint="the trainer may have restarted; re-run the step",
            )
        self._resubmitted = True
        self._operation_id = self._client._send_submission(self._submission)
        return self._operation_id


class TrainerClient(WorkerClient):
    """Client of one run's trainer worker (``run.base_url``). Thread-safe; one per run.

    ``submit_timeout``: how long a submit is retried (cold start, 502s); ``result_timeout``:
    default wait of :meth:`OpFuture.result`; ``unreachable_timeout``: how long the trainer may
    be unreachable before an op fails (a dead server ends a run with a clear message, not an
    hour of retries); ``max_unavailable_retries``: consecutive 503s without Retry-After
    tolerated before :class:`ServerShutdownError`; ``poll_backoff``: the longest pause between
    failed polls (default: the transport's).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        run_id: str | None,
        base_model: str,
        poll_hold_timeout: float = DEFAULT_POLL_HOLD_TIMEOUT,
        timeout: float = 60.0,
        submit_timeout: float = DEFAULT_SUBMIT_TIMEOUT,
        result_timeout: float = DEFAULT_RESULT_TIMEOUT,
        poll_backoff: float | None = None,
        max_unavailable_retries: int = 6,
        unreachable_timeout: float = DEFAULT_UNREACHABLE_TIMEOUT,
        **worker: Unpack[WorkerOptions],
    ):
        # The serverless gateway needs X-Run-Id on every request.
        super().__init__(base_url, api_key=api_key, run_id=run_id, timeout=timeout,
                         headers={RUN_ID_HEADER: run_id} if run_id else None, **worker)  # fmt: skip
        self.base_model = base_model
        self.poll_hold_timeout = poll_hold_timeout
        self.submit_timeout = submit_timeout
        self.result_timeout = result_timeout
        # Submits carry an Idempotency-Key: every failure is retried until the deadline.
        self._submit_policy = RetryPolicy(max_retries=None, deadline=submit_timeout, unavailable_limit=max_unavailable_retries,
                                          unreachable_limit=unreachable_timeout)  # fmt: skip
        self._poll_policy = self._submit_policy.replace(retry_statuses=frozenset({429, 502, 503, 504}))
        if poll_backoff is not None:
            self._poll_policy = self._poll_policy.replace(max_backoff=poll_backoff)
        # Held across seq_id assignment AND the POST: submit order == seq order on the wire.
        self._submit_lock = threading.Lock()
        self._next_seq = 1
        # Set after the first accepted op: from then on 400/404 are real errors, not cold start.
        self._warm = False

    # -- plain routes ----------------------------------------------------------------------

    def health(self) -> dict:
        """``GET /health?base_model=...``; returns the JSON body, raises a typed error if not 2xx."""
        _, body = self._get_json("health", params={"base_model": self.base_model})
        return body if isinstance(body, dict) else {}

    def policy_version(self) -> int:
        """``GET /policy_version`` = number of optim steps applied so far."""
        status, body = self._get_json("policy_version", accept={501})
        if status == 501:
            raise PolicyVersionUnavailableError(
                "this trainer does not expose its policy version (serverless trainer)",
                hint="use the version returned by save_weights_for_sampler",
            )
        try:
            return int(body["policy_version"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ProtocolError(f"unexpected /policy_version body: {str(body)[:200]}") from exc

    # -- ops -------------------------------------------------------------------------------

    def forward_backward(self, data: LossData, loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None,
                         top_k_logprobs: int = 0) -> OpFuture[ForwardBackwardOutput]:  # fmt: skip
        return self._submit("forward_backward", _loss_body(data, loss_fn, loss_fn_config, top_k_logprobs), ForwardBackwardOutput)

    def forward(self, data: LossData, loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None,
                top_k_logprobs: int = 0) -> OpFuture[ForwardBackwardOutput]:  # fmt: skip
        """Like :meth:`forward_backward` without gradients (safe during accumulation)."""
        return self._submit("forward", _loss_body(data, loss_fn, loss_fn_config, top_k_logprobs), ForwardBackwardOutput)

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
        """POST one op (retried with the same Idempotency-Key) and return its operation_id."""
        resp = self._http.send("POST", sub.op, json=sub.body, headers={IDEMPOTENCY_KEY_HEADER: sub.key},
                               policy=self._submit_policy, repeatable=True, retry_if=self._cold)  # fmt: skip
        self._warm = True
        return self._operation_id(resp, sub)

    def _cold(self, resp: httpx.Response) -> bool:
        """A cold trainer's "not up yet" (until it has accepted an op)."""
        return resp.status_code in _COLD_START_STATUSES and not self._warm and not is_permanent_rejection(resp)

    def _operation_id(self, resp: httpx.Response, sub: _Submission) -> str:
        body = json_body(resp)
        op_id = body.get("operation_id") if isinstance(body, dict) else None
        version = body.get("schema_version", ACCEPTANCE_SCHEMA_VERSION) if isinstance(body, dict) else None
        if not isinstance(op_id, str) or not op_id or version != ACCEPTANCE_SCHEMA_VERSION:
            raise ProtocolError(
                f"{sub.op}: unsupported operation acceptance (HTTP {resp.status_code}): {str(body)[:200]}",
                hint="the trainer speaks a different protocol version than this client",
            )
        return op_id


__all__ = ["OpFuture", "TrainerClient", "RemoteOpError", "ServerShutdownError", "ApiError"]
