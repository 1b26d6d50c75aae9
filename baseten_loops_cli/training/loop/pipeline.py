"""Keeping the trainer busy: the loop (training/loop/core.py) submits step N+1 before it waits for step N.

The trainer runs a run's ops in ``seq_id`` order, so a loop can submit ``forward_backward``,
``optim_step``, an eval's ``forward`` passes and a checkpoint save back to back and wait for
them later: each op still sees exactly the weights it would in a one-at-a-time loop (an eval
submitted after step N's ``optim_step`` and before step N+1's ``forward_backward`` measures the
policy after step N). What changes is only *when the client waits*: while the trainer computes
step N+1, the client collects step N's results, records its metrics and builds step N+2.

Records (metrics, checkpoints) are written in step order as results arrive, so the run
directory looks exactly as it would without the pipeline, and resume stays exactly-once: a
checkpoint is recorded only after its save finished, and everything after the last recorded
checkpoint is redone on resume.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

# Steps submitted ahead of the one being collected. One is enough to hide the client's
# round trip and bookkeeping (both far shorter than a step); more would only delay Ctrl-C.
DEPTH = 1


class StepPipeline:
    """Submitted-but-uncollected steps, collected in order.

    ``push(collect)`` queues a step whose ops are already submitted; ``collect()`` waits for
    its results and records them. Once more than ``depth`` steps are queued the oldest is
    collected, so at most ``depth + 1`` steps are in flight."""

    def __init__(self, depth: int = DEPTH) -> None:
        self.depth = depth
        self._pending: collections.deque[Callable[[], None]] = collections.deque()

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, collect: Callable[[], None]) -> None:
        self._pending.append(collect)
        while len(self._pending) > self.depth:
            self._pending.popleft()()

    def drain(self) -> None:
        """Collect every queued step (before a stop, an unpipelined op, or the end)."""
        while self._pending:
            self._pending.popleft()()


class StepClock:
    """Wall time per collected step. In a pipeline a step's share of the wall time is the time
    since the previous step was collected (its ops overlapped the previous step's)."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()

    def lap(self) -> tuple[float, float]:
        """(this step's share, time since the loop started), in seconds."""
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        return elapsed, now - self.started


def step_record(step: int, steps: int, clock: StepClock, *, learning_rate: float, tokens: int,
                optim_result: dict, **metrics: Any) -> dict:
    """One step's metrics record, the fields the loop writes for every kind, around the kind's
    own ``metrics`` (loss, preference accuracy, reward, ...)."""
    elapsed, time_s = clock.lap()
    record = {
        "step": step,
        **metrics,
        "learning_rate": learning_rate,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "step_time_s": elapsed,
        "time_s": time_s,
        "policy_version": step,
        "progress": step / steps,
    }
    grad_norm = (optim_result.get("metrics") or {}).get("grad_norm")
    if grad_norm is not None:
        record["grad_norm"] = grad_norm
    return record
