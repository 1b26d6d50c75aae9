"""The async-operation records behind the trainer protocol (loops-protocol.md §3.1).

An op is submitted (``POST /<op>`` -> 202 + operation id), runs later, and is collected
by long-polling ``GET /operations/{id}``: the server holds the poll until the op
finishes or ``hold`` seconds pass (then 408, "still pending"; the client re-polls at once).

This module owns the records and the waiting, not the execution (that is
``runs.RunExecutor``):

- **Idempotency.** The operation id *is* the client's ``Idempotency-Key`` (the SDK relies
  on the echo), unique per run. A retried submit with the same key finds the existing
  record and gets the same id back; the op is applied once.
- **Waiting.** Each unfinished op has an ``asyncio.Event`` set when it finishes, so a
  poll wakes the moment the result exists, not on a timer. The finished record is also kept
  in memory until its first poll answers from it, so the hot path (submit, run, poll) never
  reads a result back out of SQLite and parses its JSON again; the database copy serves
  retried polls and restarts.
- **Retention.** Results are kept ``result_ttl`` (1 h) after finishing, then dropped
  (polls answer 404, as on the hosted platform); the record itself stays for the
  idempotency window so late retries are still deduplicated.
- **Restart.** Ops that were queued or running when the server stopped can never finish;
  at startup they become errors, so a client polling them gets a clear answer instead of
  408s forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.server.errors import ApiError

RESTART_ERROR = (
    "The local loops server restarted while this operation was queued or running, so it "
    "was not applied (or only partly: a save may be missing). Resubmit it; the run resumes "
    "from its last saved state."
)


def encode_result(result: Any) -> str:
    """An op's result as the JSON text its polls answer (compact, like every JSON answer).
    A diverged loss is written as ``NaN`` (Python's json, the SDK's and ours, reads it back)
    rather than turning every poll of the op into a 500."""
    try:
        return json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(result, ensure_ascii=False, separators=(",", ":"))


@dataclasses.dataclass(frozen=True)
class PollAnswer:
    """What ``GET /operations/{id}`` answers: the op finished (``done`` or ``failed``), or
    is still pending or running after the hold (neither)."""

    row: st.OperationRow

    @property
    def done(self) -> bool:
        return self.row.status == st.OP_DONE

    @property
    def failed(self) -> bool:
        return self.row.status == st.OP_ERROR


class OperationRegistry:
    def __init__(self, store: st.Store, *, result_ttl_s: float, idempotency_window_s: float):
        self.store = store
        self.result_ttl_s = result_ttl_s
        self.idempotency_window_s = max(idempotency_window_s, result_ttl_s)
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self._finished: dict[tuple[str, str], st.OperationRow] = {}
        self._submitted: dict[tuple[str, str], st.OperationRow] = {}

    # ── submission ──

    def find(self, run_id: str, op_id: str) -> st.OperationRow | None:
        return self.store.get_operation(run_id, op_id)

    def create(self, run_id: str, op: str, idempotency_key: str | None,
               seq_id: int | None) -> st.OperationRow:
        op_id = idempotency_key or uuid.uuid4().hex
        row = self.store.insert_operation(run_id=run_id, op_id=op_id, op=op,
                                          idempotency_key=idempotency_key, seq_id=seq_id)
        if row.status not in st.FINISHED_OP_STATUSES and (run_id, op_id) not in self._events:
            self._events[(run_id, op_id)] = asyncio.Event()
            self._submitted[(run_id, op_id)] = row
        return row

    # ── progress ──

    def mark_running(self, run_id: str, op_id: str) -> None:
        self.store.mark_operation_running(run_id, op_id)

    def finish(self, run_id: str, op_id: str, *, result: Any = None, error: str | None = None,
               error_class: str | None = None) -> None:
        # Encoded once: the same text goes to the database and, from memory, to the poller.
        result_json = encode_result(result) if error is None else None
        now = time.time()
        self.store.finish_operation(run_id, op_id, result_json=result_json, error=error,
                                    error_class=error_class, finished_at=now)
        row = self._finished_row(run_id, op_id, result_json, error, error_class, now)
        if row is not None:
            self._finished[(run_id, op_id)] = row
        event = self._events.pop((run_id, op_id), None)
        if event is not None:
            event.set()

    def _finished_row(self, run_id: str, op_id: str, result_json: str | None, error: str | None,
                      error_class: str | None, now: float) -> st.OperationRow | None:
        if (run_id, op_id) not in self._events:
            return None  # not submitted through this registry (e.g. before a restart)
        status = st.OP_DONE if error is None else st.OP_ERROR
        row = self._submitted.pop((run_id, op_id), None)
        if row is None:
            return None
        return dataclasses.replace(row, status=status, result_json=result_json, error=error,
                                   error_class=(error_class or "Error") if error else None,
                                   finished_at=now)

    def fail_pending(self, run_id: str, error: str, error_class: str) -> None:
        for op_id in self.store.fail_pending_operations_of_run(run_id, error, error_class):
            self._submitted.pop((run_id, op_id), None)
            event = self._events.pop((run_id, op_id), None)
            if event is not None:
                event.set()

    # ── polling ──

    async def wait(self, run_id: str, op_id: str, hold_s: float) -> st.OperationRow | None:
        """The op's record once finished, or as it stands after ``hold_s``; None if unknown."""
        finished = self._finished.pop((run_id, op_id), None)
        if finished is not None:
            return finished
        event = self._events.get((run_id, op_id))
        if event is None:
            return self.store.get_operation(run_id, op_id)  # finished earlier, or unknown
        if hold_s > 0:
            try:
                await asyncio.wait_for(event.wait(), hold_s)
            except asyncio.TimeoutError:
                pass
        finished = self._finished.pop((run_id, op_id), None)
        return finished if finished is not None else self.store.get_operation(run_id, op_id)

    async def poll(self, run_id: str, op_id: str, hold_s: float) -> PollAnswer:
        """:meth:`wait`, for the long-poll route: 404 for an op never submitted (or purged)
        and for one whose result expired."""
        row = await self.wait(run_id, op_id, hold_s)
        if row is None:
            raise ApiError(404, f"No operation {op_id!r} on run {run_id}: it was never "
                                "submitted here, or finished long ago. Resubmit it with the "
                                "same Idempotency-Key.", "UnknownOperation")
        if row.status == st.OP_EXPIRED:
            raise ApiError(404, f"Operation {op_id}'s result expired ({self.result_ttl_s:.0f}s "
                                "after it finished). Resubmitting with the same Idempotency-Key "
                                "will not re-run it.", "ResultExpired")
        return PollAnswer(row)

    # ── housekeeping ──

    def recover_after_restart(self) -> int:
        return self.store.fail_unfinished_operations(RESTART_ERROR, "ServerRestarted")

    def expire(self, now: float | None = None) -> None:
        now = now or time.time()
        for key, row in list(self._finished.items()):  # never polled: the database has them
            if row.finished_at is not None and row.finished_at < now - self.result_ttl_s:
                del self._finished[key]
        self.store.expire_operation_results(now - self.result_ttl_s)
        self.store.purge_operations(now - self.idempotency_window_s)
