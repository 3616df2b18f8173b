"""glibc malloc settings for the server's process: big temporaries reused, not re-faulted.

Every request makes megabytes of short-lived buffers (a decoded picture, the resize's
intermediates, the answer's pieces) while the caches keep megabytes of long-lived ones. glibc
serves blocks above its mmap threshold with fresh mappings and unmaps them when freed, and
gives freed heap memory back to the system above its trim threshold; either way the next
request's buffers are new pages, and the kernel zero-fills each one on first touch, which costs
milliseconds per request. Raising both thresholds keeps freed memory in the heap for the next
request. The cost is that the process keeps up to ``trim`` bytes of free memory it would
otherwise return.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest allowed value on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""Free memory at the heap's top kept before any is returned to the system."""

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds for this process; False where the C library is not
    glibc (nothing is changed there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and others have no mallopt tuning)
    except (OSError, AttributeError, TypeError):
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim))
    if not ok:
        logger.warning("glibc refused the malloc thresholds (mmap %d, trim %d)", mmap, trim)
    return ok
