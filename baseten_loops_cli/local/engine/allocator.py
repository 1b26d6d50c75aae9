"""The C allocator's policy for the engine's CPU tensors (issue 40).

Profile (SmolLM2-135M SFT, one 8,000-token row, bf16, every decoder layer checkpointed):
glibc's live bytes (``mallinfo2``: in use + mmapped) peaked at 1.3 GiB during the
forward_backward, while the process's RSS peaked at 3.6 GiB; after the step 2.5 GiB sat
*free* inside malloc's heaps and stayed there. CPU tensors come from ``malloc``, and glibc
raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB on 64-bit),
so from the first step on every activation under 32 MiB (an 8k x 576 float32 hidden state is
18 MiB, an 8k x 1536 bf16 MLP activation 25 MiB) is carved out of the heaps, shared between
threads' arenas, where freed blocks fragment and are not given back.

- Outside long steps a fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the
  dynamic raise off) keeps every block of :data:`MMAP_THRESHOLD_BYTES` or more in a mapping of
  its own, returned to the system when the tensor is freed: the RSS follows the live bytes.
  Smaller blocks (the short rows' activations, everything of a 64-token batch) stay in the
  heap, so short steps pay no page faults for it.
- A mapping of its own costs a page fault per 4 KiB the first time it is touched: an 8k step
  mapped and faulted in tens of GB, a fifth of its time (in-process, 95 s at 2.23 GiB against
  74 s at 4.15 GiB with glibc's default). So a step that checkpoints layers runs under
  :class:`long_step`: its blocks under :data:`LONG_STEP_MMAP_THRESHOLD_BYTES` come from the
  heap, whose pages stay mapped from one layer to the next, and
  :func:`release_if_grown`, called between layers, gives the heap's free pages back once the RSS
  has grown by :data:`RELEASE_AFTER_GROWTH_BYTES`.
- The heap fragments where long-lived blocks sit among a layer's transient ones. The blocks a
  backward keeps across layers (a checkpointed layer's output, its attention's output) go to
  mappings of their own instead (:func:`mapped_copies`): then the heap is transient blocks
  only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

# Blocks of at least this many bytes get a mapping of their own (see the module docstring).
# Each such block costs page faults when it is touched: with 4 MiB a 4k-token SmolLM2 row
# trained at 100 tokens/s against 144 with glibc's default, because most of its tensors (a
# (4k x 576) float32 hidden state is 9 MiB) were mapped and unmapped at every use. 8 MiB: 134
# tokens/s at 4k, and the 8k row peaks at 2.44 GiB in-process (2.10 with 4 MiB, 3.00 with
# 16 MiB, 3.94 with the default).
MMAP_THRESHOLD_BYTES = 8 * 2**20
# During a long step (:class:`long_step`): blocks under this size come from the heap.
LONG_STEP_MMAP_THRESHOLD_BYTES = 64 * 2**20
# During a long step: the heap's free pages go back to the system each time the RSS has grown
# by this much since they last did (:func:`release_if_grown`).
RELEASE_AFTER_GROWTH_BYTES = 768 * 2**20
# Blocks kept across layers are mapped on their own from this size (:func:`mapped_copies`).
KEPT_MAPPED_MIN_BYTES = 4 * 2**20
_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's
_GLIBC_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own tunable: the user's choice wins
_ALIGNMENT = 64
_libc: Any = None  # set by configure_allocator
_threshold = MMAP_THRESHOLD_BYTES
_last_release_rss: int | None = None  # inside a long step: the RSS after the last release


def configure_allocator(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold for this process; False where there is nothing to set (not
    glibc, or the user set ``MALLOC_MMAP_THRESHOLD_`` themselves). Also what enables
    :class:`long_step`."""
    global _libc, _threshold
    if not sys.platform.startswith("linux") or os.environ.get(_GLIBC_ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    if libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused", threshold)
        return False
    _libc, _threshold = libc, int(threshold)
    return True


@contextlib.contextmanager
def long_step(block_bytes: int) -> Iterator[None]:
    """The allocator's policy for a step that checkpoints layers (see the module docstring),
    whose activations come in blocks of about ``block_bytes`` (a float32 hidden state): the
    heap serves blocks under :data:`LONG_STEP_MMAP_THRESHOLD_BYTES` and is not trimmed by
    glibc, only by :func:`release_if_grown`; on exit the process's policy is back and the
    heap's free pages are returned.

    Does nothing where the blocks are under the process's threshold (they come from the heap
    anyway: a 2k-token SmolLM2 row ran 9.7 s a step without the policy, 10.6 with it, its
    releases re-faulting pages), or unless :func:`configure_allocator` set the policy. Not
    reentrant: one training step runs at a time on a base (its lock); a step on another base
    that overlaps one under the policy runs under it as it is."""
    global _last_release_rss
    if _libc is None or _last_release_rss is not None or block_bytes < _threshold:
        yield
        return
    _libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    _libc.mallopt(_M_MMAP_THRESHOLD, LONG_STEP_MMAP_THRESHOLD_BYTES)
    _last_release_rss = _resident_bytes()
    try:
        yield
    finally:
        _last_release_rss = None
        _libc.mallopt(_M_MMAP_THRESHOLD, _threshold)
        _libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        _libc.malloc_trim(0)


def release_if_grown() -> None:
    """Inside :class:`long_step`, between layers: give the heap's free pages back once the RSS
    has grown by :data:`RELEASE_AFTER_GROWTH_BYTES` since they last were. Freed blocks are
    reused in place from layer to layer, but not all of them: the heap's footprint creeps up
    by tens of MB a layer at 8k tokens. Releasing at every layer re-faults each layer's
    blocks (13 GB of page faults in an 8k forward); past a growth bound, a few times a step."""
    global _last_release_rss
    if _last_release_rss is None:
        return
    if _resident_bytes() - _last_release_rss >= RELEASE_AFTER_GROWTH_BYTES:
        _libc.malloc_trim(0)
        _last_release_rss = _resident_bytes()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def mapped_copies(*tensors: Any) -> tuple[Any, ...]:
    """Inside :class:`long_step`, the tensors' values in one anonymous private mapping,
    unmapped when the last copy is freed; elsewhere, or where together they are under
    :data:`KEPT_MAPPED_MIN_BYTES`, the tensors themselves. For the blocks a backward keeps
    across decoder layers (see the module docstring): out of malloc's heap, they do not pin
    it, so the heap serves the layers' transient blocks again and again."""
    if _last_release_rss is None:  # outside a long step (every short row's attention): as is
        return tensors
    import torch

    sizes = [t.numel() * t.element_size() for t in tensors]
    if sum(sizes) < KEPT_MAPPED_MIN_BYTES or any(t.device.type != "cpu" for t in tensors):
        return tensors
    offsets = []
    end = 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // _ALIGNMENT) * _ALIGNMENT
    buffer = mmap.mmap(-1, end, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return tuple(
        torch.frombuffer(buffer, dtype=t.dtype, count=t.numel(), offset=offset)
        .view(t.shape).copy_(t)
        for t, offset in zip(tensors, offsets))
