"""Points inside a job where its thread may change its torch intra-op thread count.

The server runs a base model's training and sampling on two threads (server/compute.ModelWorker)
and splits the cores between them while both are busy. It decides when a job starts, but the
two rarely start together: in async RL the client submits a step's forward_backward a few
milliseconds before the next batch's sample request, so the training job started alone with
every thread and kept them while the sampler ran beside it with one: three busy threads on two
cores, and a team of OpenMP threads whose barriers wait for a descheduled member. On the 2-core
machine the tiny model's forward_backward then took 200-370 ms instead of 112 alone, and a
sample job that ended first left the training job on its half for the rest of its run.

So the engine calls :func:`checkpoint` where a thread count may change between two ops: before
each decoder layer's forward (every decode step of a sampler, every layer of a training
forward, and of a checkpointed layer's recompute) and when each layer's output gradient is
ready in the backward. The job's lane binds what to do there (:func:`deciding`): re-decide its
share now. Outside a bound job a checkpoint does nothing, so the engine's own tests and a
bench's in-process loops are unaffected.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

_bound = threading.local()  # .decide: this thread's callable, or absent


@contextlib.contextmanager
def deciding(decide: Callable[[], None]) -> Iterator[None]:
    """Run the block with ``decide`` called at every checkpoint on this thread."""
    before = getattr(_bound, "decide", None)
    _bound.decide = decide
    try:
        yield
    finally:
        _bound.decide = before


def checkpoint() -> None:
    """Let the job running on this thread re-decide its thread count (no-op when none is bound)."""
    decide = getattr(_bound, "decide", None)
    if decide is not None:
        decide()


def _before_layer(module: Any, args: Any) -> None:
    checkpoint()


def _after_layer(module: Any, args: Any, output: Any) -> None:
    hidden = output[0] if isinstance(output, tuple) and output else output
    if isinstance(hidden, torch.Tensor) and hidden.requires_grad and getattr(_bound, "decide", None):
        hidden.register_hook(_on_gradient)


def _on_gradient(grad: torch.Tensor) -> None:
    checkpoint()  # returns None: the gradient passes unchanged


def install(layers: list[Any]) -> None:
    """Checkpoints around each of ``layers`` (a model's decoder layers): a forward pre-hook,
    and a hook on the output's gradient when the forward records a graph."""
    for layer in layers:
        layer.register_forward_pre_hook(_before_layer)
        layer.register_forward_hook(_after_layer)
