"""glibc's malloc settings for processes that are mmproc's own: freed megabyte buffers kept.

Preprocessing allocates megabytes per request and frees most of them again: the decoded pixels,
the patches, an answer's base64. glibc's malloc hands such buffers back to the kernel when they
are freed (``munmap``, or trimming the top of a heap), so the next request's buffers are new
pages, each faulted in and zeroed by the kernel. :func:`keep_freed_memory` makes malloc serve
buffers up to 32 MiB from its heaps and keep up to ``trim_threshold`` bytes free at a heap's top,
so freed buffers are reused without the kernel.

Only processes mmproc owns call it (``mmproc serve``, a process worker): a library must not
change its host process's allocator. A setting the operator made with glibc's own environment
variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_ARENA_MAX``,
``MALLOC_TOP_PAD_``) or ``GLIBC_TUNABLES`` is left as they set it. Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = [
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "apply_malloc_settings",
    "glibc",
    "keep_freed_memory",
]

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

#: Allocations up to this size come from malloc's heaps, so their memory is reused once freed:
#: glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit). Larger ones (a long video's frames) are still
#: mapped on their own and given back when freed.
MMAP_THRESHOLD = 32 << 20

#: Free memory a heap keeps at its top before giving it back: a few concurrent requests' buffers.
TRIM_THRESHOLD = 512 << 20

# glibc's environment variable and GLIBC_TUNABLES name of each setting.
_OPERATOR_NAMES = {
    M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
    M_ARENA_MAX: ("MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
    M_TOP_PAD: ("MALLOC_TOP_PAD_", "glibc.malloc.top_pad"),
}


def glibc() -> ctypes.CDLL | None:
    """The C library, with ``mallopt`` typed; None where it is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _set_by_operator(parameter: int) -> bool:
    env, tunable = _OPERATOR_NAMES[parameter]
    return env in os.environ or tunable + "=" in os.environ.get("GLIBC_TUNABLES", "")


def apply_malloc_settings(libc: ctypes.CDLL, settings: dict[int, int]) -> dict[str, int]:
    """``mallopt`` each setting the operator left alone; returns what was set, by env name."""
    applied: dict[str, int] = {}
    for parameter, value in settings.items():
        if _set_by_operator(parameter):
            continue
        if libc.mallopt(parameter, value) == 1:
            applied[_OPERATOR_NAMES[parameter][0].strip("_").lower()] = value
        else:
            logger.debug("mallopt(%d, %d) was refused", parameter, value)
    return applied


def keep_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> dict[str, int]:
    """Set glibc's mmap and trim thresholds for this process; returns what was set.

    Returns an empty dict where the C library is not glibc or ``mallopt`` refuses.
    """
    libc = glibc()
    if libc is None:
        return {}
    return apply_malloc_settings(
        libc, {M_MMAP_THRESHOLD: mmap_threshold, M_TRIM_THRESHOLD: trim_threshold}
    )
