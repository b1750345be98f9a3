"""Host-memory reuse between steps (glibc's malloc).

A training or MD step allocates and frees the same tens to hundreds of MiB of
activations at every call. With glibc's defaults, blocks above the mmap threshold
(dynamic, at most 32 MiB) are fresh ``mmap`` s that ``free`` unmaps, and the top of
the heap is trimmed back to the system above the trim threshold. The next step then
page-faults every page in again, each zero-filled by the kernel: a noticeable
share of a compiled training step on a CPU (docs/performance.md has the figures).

:func:`keep_freed_memory` raises both thresholds so that freed blocks stay in the
process for the next step. The resident size then stays at the peak of a step
instead of falling back between steps. It is process-wide, so petfunc's command
line applies it, and library code calls it when it wants it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied = False


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Serve blocks up to ``threshold`` bytes from the heap and never trim it.

    Sets glibc's ``M_MMAP_THRESHOLD`` to ``threshold`` (older glibc caps it at 32
    MiB; that value is used where the larger one is refused) and ``M_TRIM_THRESHOLD``
    to twice that. Idempotent.

    Returns:
        True when applied (Linux with glibc), False elsewhere (macOS, musl, Windows),
        where nothing is changed.
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    threshold = min(int(threshold), 1 << 30)  # twice it must fit a C int
    for value in (threshold, 32 << 20):
        if mallopt(_M_MMAP_THRESHOLD, value) == 1:
            mallopt(_M_TRIM_THRESHOLD, 2 * value - 1)
            _applied = True
            return True
    return False
