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
"""

from __future__ import annotations

import asyncio
import inspect
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

        def work() -> None:
            try:
                value = _call(fn, args)
            except BaseException as exc:  # the user's code: everything it raises is its failure
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                failure = RolloutFailed(f"{what} raised {type(exc).__name__}: {exc}", text)
                try:
                    loop.call_soon_threadsafe(settle, False, failure)
                except RuntimeError:
                    pass  # the loop is gone (the call was abandoned)
                return
            try:
                loop.call_soon_threadsafe(settle, True, value)
            except RuntimeError:
                pass

        async with self._slots:
            threading.Thread(target=work, name=f"loops-user-code:{what}", daemon=True).start()
            try:
                return await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
            except asyncio.TimeoutError:
                # Whatever the abandoned call ends with later is nobody's: mark it retrieved, so
                # asyncio does not log "exception was never retrieved".
                done.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise RolloutFailed(f"{what} did not return within reward_timeout_s={self.timeout_s:g}s",
                                    f"{what} timed out after {self.timeout_s:g}s (reward_timeout_s)") from None
