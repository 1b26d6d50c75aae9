"""Running a user's reward or environment code so that it can cost a rollout, never the run.

Every call goes to a thread of its own, at most ``workers`` at a time, and is awaited for at
most ``timeout_s`` seconds: a slow or hanging call blocks neither the other rollouts' sampling
(the event loop keeps serving them) nor the training step. A call that raises, returns the
wrong type or runs past its timeout raises :class:`RolloutFailed` carrying the traceback, which
the RL loop records in samples.jsonl; the run stops only when too many of a batch fail.

Threads, not processes: an environment is a live object with state across turns and a
reward may close over anything, so neither can be sent to another process. A call past its
timeout is abandoned (its daemon thread may still be running; it holds no slot and does not
keep the process alive at exit).

The threads are parked between calls and reused (:func:`_start`): a thread started per call
cost the tiny RL example 14 ms a batch of 64 rewards, on the path of every step, because
``Thread.start`` waits until the new thread runs, which a busy machine delays. A hung call
keeps its thread, so the next call gets another one.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import traceback
from typing import Any, Callable


class RolloutFailed(Exception):
    """A user's reward or environment call failed; ``detail`` is its traceback (or the reason)."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    value = fn(*args)
    if inspect.isawaitable(value):  # `async def` reset/step/reward: run it here, off the main loop

        async def wait() -> Any:
            return await value

        value = asyncio.run(wait())
    return value


# Parked threads waiting for a call: each one's inbox. At most MAX_PARKED stay parked; a parked
# thread waits for its next call as long as the process lives (no timeout: threads that exit
# on their own would change the process's thread count at any moment).
_parked: list[queue.SimpleQueue] = []
_parked_lock = threading.Lock()
MAX_PARKED = 64


def _start(job: Callable[[], Callable[[], None]]) -> None:
    """Run ``job`` on a parked thread, or on a new one when none is parked.

    ``job`` returns what delivers its result; the thread parks itself *before* it delivers, so
    a caller that starts its next call as soon as it has the result finds this thread parked
    (delivering first raced the re-park and started a new thread now and then)."""
    with _parked_lock:
        inbox = _parked.pop() if _parked else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name="loops-user-code", daemon=True).start()
    inbox.put(job)


def _serve(inbox: queue.SimpleQueue) -> None:
    while True:
        deliver = inbox.get()()
        with _parked_lock:
            park = len(_parked) < MAX_PARKED
            if park:
                _parked.append(inbox)
        deliver()
        if not park:
            return


class Isolated:
    """Calls of user code with a per-call timeout on at most ``workers`` threads at once."""

    def __init__(self, *, timeout_s: float, workers: int) -> None:
        self.timeout_s = timeout_s
        self.workers = workers
        self._slots: asyncio.Semaphore | None = None

    async def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (awaited when it returns an awaitable), or :class:`RolloutFailed`."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(ok: bool, payload: Any) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(payload)

        def work() -> Callable[[], None]:
            threading.current_thread().name = f"loops-user-code:{what}"
            try:
                outcome: tuple[bool, Any] = (True, _call(fn, args))
            except BaseException as exc:  # the user's code: everything it raises is its failure
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                outcome = (False, RolloutFailed(f"{what} raised {type(exc).__name__}: {exc}", text))

            def deliver() -> None:
                try:
                    loop.call_soon_threadsafe(settle, *outcome)
                except RuntimeError:
                    pass  # the loop is gone (the call was abandoned)

            return deliver

        async with self._slots:
            _start(work)
            try:
                return await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
            except asyncio.TimeoutError:
                # Whatever the abandoned call ends with later is nobody's: mark it retrieved, so
                # asyncio does not log "exception was never retrieved".
                done.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise RolloutFailed(f"{what} did not return within reward_timeout_s={self.timeout_s:g}s",
                                    f"{what} timed out after {self.timeout_s:g}s (reward_timeout_s)") from None
