"""The C allocator's policy for the engine's CPU tensors (issue 40).

Profile (SmolLM2-135M SFT, one 8,000-token row, bf16, every decoder layer checkpointed):
glibc's live bytes (``mallinfo2``: in use + mmapped) peaked at 1.3 GiB during the
forward_backward, while the process's RSS peaked at 3.6 GiB; after the step 2.5 GiB sat
*free* inside malloc's heaps and stayed there. CPU tensors come from ``malloc``, and glibc
raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB on 64-bit),
so from the first step on every activation under 32 MiB (an 8k x 576 float32 hidden state is
18 MiB, an 8k x 1536 bf16 MLP activation 25 MiB) is carved out of the heaps, shared between
threads' arenas, where freed blocks fragment and are not given back.

A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic raise off)
keeps every block of :data:`MMAP_THRESHOLD_BYTES` or more in a mapping of its own, returned to
the system when the tensor is freed: the RSS follows the live bytes. Smaller blocks (the short
rows' activations, everything of a 64-token batch) stay in the heaps, so short steps pay no
page faults for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# Blocks of at least this many bytes get a mapping of their own (see the module docstring).
# Each such block costs page faults when it is touched: with 4 MiB a 4k-token SmolLM2 row
# trained at 100 tokens/s against 144 with glibc's default, because most of its tensors (a
# (4k x 576) float32 hidden state is 9 MiB) were mapped and unmapped at every use. 8 MiB: 134
# tokens/s at 4k, and the 8k row peaks at 2.44 GiB in-process (2.10 with 4 MiB, 3.00 with
# 16 MiB, 3.94 with the default).
MMAP_THRESHOLD_BYTES = 8 * 2**20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_GLIBC_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own tunable: the user's choice wins


def configure_allocator(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold for this process; False where there is nothing to set (not
    glibc, or the user set ``MALLOC_MMAP_THRESHOLD_`` themselves)."""
    if not sys.platform.startswith("linux") or os.environ.get(_GLIBC_ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused", threshold)
        return False
    return True
