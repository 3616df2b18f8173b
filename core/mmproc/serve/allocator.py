"""The serving process's allocator: freed megabyte buffers kept for the next request.

Every rendered request allocates megabytes and frees most of them again: the decoded pixels,
the patches, the base64 of the answer. glibc's malloc hands such buffers back to the kernel when
they are freed (``munmap``, or trimming the top of a heap), so the next request's buffers are
new pages, each faulted in and zeroed by the kernel. Under concurrent load that kernel work is
the largest single cost of a request (more than its JPEG decode). :func:`keep_freed_memory`
makes malloc serve buffers up to 32 MiB from its heaps and keep up to ``trim_threshold`` bytes
free at a heap's top, so freed buffers are reused without the kernel.

Only ``mmproc serve`` calls it: a library must not change its host process's allocator. A
setting the operator made with glibc's own environment variables (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``) is left as they set it. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this size come from malloc's heaps, so their memory is reused once freed:
#: glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit). Larger ones (a long video's frames) are still
#: mapped on their own and given back when freed.
MMAP_THRESHOLD = 32 << 20

#: Free memory a heap keeps at its top before giving it back: a few concurrent requests' buffers.
TRIM_THRESHOLD = 512 << 20


def keep_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> dict[str, int]:
    """Set glibc's mmap and trim thresholds for this process; returns what was set.

    Returns an empty dict where the C library is not glibc or ``mallopt`` refuses.
    """
    if platform.libc_ver()[0] != "glibc":
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied: dict[str, int] = {}
    for env, parameter, value in (
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, mmap_threshold),
        ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, trim_threshold),
    ):
        if env in os.environ:
            continue
        if mallopt(parameter, value) == 1:
            applied[env.strip("_").lower()] = value
        else:
            logger.debug("mallopt(%d, %d) was refused", parameter, value)
    return applied
