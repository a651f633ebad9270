"""The C heap of `loraplex serve`: large blocks get pages of their own, so freeing them gives the memory back.

glibc serves an allocation from its heap unless it is at least the mmap threshold, and that threshold is dynamic:
each time a mapped block is freed it rises to that block's size, up to 32 MiB. A model load frees large buffers, so
afterwards every tensor below 32 MiB (adapter layers and tables, per-step activations and logits) comes from the
heap, whose freed holes are rarely returned: under adapter churn the heap kept growing with no live allocation
behind it (bench/README.md, "Memory under adapter churn"). ``fix_mmap_threshold`` pins the threshold,
which also turns the dynamic rise off. An operator's own ``MALLOC_MMAP_THRESHOLD_`` (glibc's variable) wins, and
other C libraries are left as they are.

Called once by the entry point, before the model load; nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold"]

MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own initial threshold, kept from rising
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES, env: Mapping[str, str] | None = None) -> str:
    """Pin glibc's mmap threshold at ``nbytes``. Returns what was done, for the start-up log line: ``"set"``,
    ``"environment"`` (``MALLOC_MMAP_THRESHOLD_`` is set: glibc read it at start) or ``"unsupported"`` (not glibc)."""
    if "MALLOC_MMAP_THRESHOLD_" in (os.environ if env is None else env):
        return "environment"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return "unsupported"
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl's mallopt ignores this parameter)
        return "unsupported"
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return "set" if libc.mallopt(_M_MMAP_THRESHOLD, nbytes) == 1 else "unsupported"
