"""The one polling helper: ask, wait ``interval``, ask again, until an answer or a deadline.

Every status wait of the client side is a loop over a :class:`Poll`: an op's result and a
queued sample (``WorkerClient._await_operation``), a sampler reaching a policy version, a trainer
coming up, a deployment becoming ACTIVE, ``runs watch`` and ``runs logs --follow``::

    poll = Poll(interval=2.0, timeout=600, sleep=sleep)
    for _ in poll:
        status = ask()
        if status == "ACTIVE":
            return status
    raise LoopsError(f"still {status} after {poll.timeout:g}s")

The first attempt comes at once, each next one ``interval`` later, and no wait runs past the
deadline, so the last attempt is made at the deadline; the loop ends after an attempt made at
or past it (without ``timeout`` it runs until the caller returns). ``again()`` makes the next
attempt come at once (a long-poll the server held has waited already; a full page of logs
means more is waiting). ``sleep`` and ``clock`` are injected, as the transport's are, so tests
run without waiting.

Polling asks until something *changes*; re-sending a request that *failed* is the transport's
job (``api.http``: ``RetryPolicy`` and ``decide``), never a loop here.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator

Sleep = Callable[[float], None]
Clock = Callable[[], float]


class Poll:
    """One polling loop: iterate it; each iteration is one attempt (numbered from 1).

    ``interval``: seconds between attempts; ``timeout``: seconds from now after which the loop
    ends (None: no deadline); ``sleep`` / ``clock``: what waits and what tells the time
    (default ``time.sleep`` / ``time.monotonic``).
    """

    def __init__(self, *, interval: float, timeout: float | None = None, sleep: Sleep = time.sleep,
                 clock: Clock = time.monotonic):  # fmt: skip
        if interval < 0:
            raise ValueError(f"interval must be >= 0, not {interval}")
        self.interval = interval
        self.timeout = timeout
        self.attempts = 0
        self._sleep = sleep
        self._clock = clock
        self._started = clock()
        self._deadline = None if timeout is None else self._started + timeout
        self._next_wait: float | None = None

    def remaining(self) -> float:
        """Seconds left before the deadline (``math.inf`` without one; never below 0)."""
        if self._deadline is None:
            return math.inf
        return max(self._deadline - self._clock(), 0.0)

    def elapsed(self) -> float:
        """Seconds since the poll began."""
        return self._clock() - self._started

    @property
    def expired(self) -> bool:
        return self._deadline is not None and self._clock() >= self._deadline

    def again(self) -> None:
        """Make the next attempt at once (if time remains)."""
        self._next_wait = 0.0

    def __iter__(self) -> Iterator[int]:
        while True:
            self.attempts += 1
            yield self.attempts
            if self.expired:
                return
            wait = self.interval if self._next_wait is None else self._next_wait
            self._next_wait = None
            wait = min(wait, self.remaining())
            if wait > 0:
                self._sleep(wait)


__all__ = ["Clock", "Poll", "Sleep"]
