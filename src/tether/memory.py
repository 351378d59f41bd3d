"""Handing a process's freed memory back to the OS between a run's phases (``train.malloc_trim``).

Freed tensors on CPU go back to the C allocator (glibc's arenas), which keeps their pages resident.
`malloc_trim` returns them. Where a step's memory goes (the sizes of what it holds, each phase's peak)
is measured by the benchmarks' instrumentation, ``bench/_memory.py``, outside the package.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_LIBC = None


def malloc_trim() -> bool:
    """Return glibc's free heap pages to the OS (``malloc_trim(0)``); False where there is no glibc.

    Freed tensors on CPU go back to glibc, which keeps most of them in its arenas (resident, reusable
    by the next allocations, but counted in RSS and unavailable to other processes). ``malloc_trim``
    releases every free page of every arena, at the cost of page faults when memory is needed again.
    """
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True
