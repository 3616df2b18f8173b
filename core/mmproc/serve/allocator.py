"""The serving process's allocator: freed megabyte buffers kept for the next request, and the
heap's top faulted in ahead of the requests.

Every rendered request allocates megabytes and frees most of them again: the decoded pixels,
the patches, the base64 of the answer. glibc's malloc hands such buffers back to the kernel when
they are freed (``munmap``, or trimming the top of a heap), so the next request's buffers are
new pages, each faulted in and zeroed by the kernel. :func:`keep_freed_memory` makes malloc serve
buffers up to 32 MiB from its heaps and keep up to ``trim_threshold`` bytes free at a heap's top,
so freed buffers are reused without the kernel.

What a request keeps is new memory all the same: the processor's cache holds every new item's
outputs (megabytes per picture) until it is full. Faulting those pages in on the request's path
costs as much as decoding its JPEG, and concurrent faults of one process contend in the kernel.
:func:`reserve_heap` starts a thread that keeps the top of malloc's one heap faulted in ahead of
the requests (``madvise(MADV_POPULATE_WRITE)``, which maps pages without touching what they
hold, so it is safe on memory in use), woken by :func:`make_room` as each request comes in.

Only ``mmproc serve`` calls these: a library must not change its host process's allocator. A
setting the operator made with glibc's own environment variables (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_ARENA_MAX``, ``MALLOC_TOP_PAD_``) or ``GLIBC_TUNABLES`` is
left as they set it. Elsewhere than glibc they do nothing.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import threading

__all__ = [
    "HEAP_RESERVE",
    "MMAP_THRESHOLD",
    "TOP_PAD",
    "TRIM_THRESHOLD",
    "HeapReserve",
    "keep_freed_memory",
    "make_room",
    "reserve_heap",
]

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_POPULATE_STEP = 4 << 20  # bytes per madvise call: allocations go on between them

#: Allocations up to this size come from malloc's heaps, so their memory is reused once freed:
#: glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit). Larger ones (a long video's frames) are still
#: mapped on their own and given back when freed.
MMAP_THRESHOLD = 32 << 20

#: Free memory a heap keeps at its top before giving it back: a few concurrent requests' buffers.
TRIM_THRESHOLD = 512 << 20

#: Free, faulted-in bytes :func:`reserve_heap` keeps at the heap's top: several pictures'
#: outputs. Below :data:`MMAP_THRESHOLD`, so that reserving it takes heap memory.
HEAP_RESERVE = 24 << 20

#: How much more the heap grows each time it must (``M_TOP_PAD``): the reserve is refilled in
#: few, large steps.
TOP_PAD = 64 << 20

# glibc's environment variable and GLIBC_TUNABLES name of each setting.
_OPERATOR_NAMES = {
    _M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    _M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
    _M_ARENA_MAX: ("MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
    _M_TOP_PAD: ("MALLOC_TOP_PAD_", "glibc.malloc.top_pad"),
}


def _libc() -> ctypes.CDLL | None:
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


def _apply(libc: ctypes.CDLL, settings: dict[int, int]) -> dict[str, int]:
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
    libc = _libc()
    if libc is None:
        return {}
    return _apply(libc, {_M_MMAP_THRESHOLD: mmap_threshold, _M_TRIM_THRESHOLD: trim_threshold})


class HeapReserve:
    """A thread that keeps ``reserve`` bytes free and faulted in at the top of malloc's heap.

    Each refill allocates and frees ``reserve`` bytes (so the heap grows, by ``top_pad`` more,
    when its top holds less), then populates what the heap grew by since the last refill (at
    most its last ``reserve + top_pad`` bytes): new pages are mapped, pages in use are left as
    they are, so the next buffers malloc carves from the top are memory the kernel has already
    given. Made by :func:`reserve_heap`.
    """

    def __init__(
        self, libc: ctypes.CDLL, floor: int, reserve: int, top_pad: int, interval: float | None
    ) -> None:
        self._malloc = libc.malloc
        self._malloc.argtypes = (ctypes.c_size_t,)
        self._malloc.restype = ctypes.c_void_p
        self._free = libc.free
        self._free.argtypes = (ctypes.c_void_p,)
        self._sbrk = libc.sbrk
        self._sbrk.argtypes = (ctypes.c_ssize_t,)
        self._sbrk.restype = ctypes.c_void_p
        self._madvise = libc.madvise
        self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._madvise.restype = ctypes.c_int
        self._floor = floor
        self._reserve = reserve
        self._window = reserve + top_pad
        self._populated = 0  # the heap's top at the last refill
        self._interval = interval
        self._wanted = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        #: Refills done so far.
        self.fills = 0
        #: The malloc settings :func:`reserve_heap` made for it, by environment name.
        self.applied: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="mmproc-heap-reserve", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def make_room(self) -> None:
        """Ask for a refill (a request is coming in); returns at once."""
        self._wanted.set()

    def fill(self) -> bool:
        """Refill now, on this thread; False when the kernel cannot populate (then stop)."""
        with self._lock:
            block = self._malloc(self._reserve)
            if block:
                self._free(block)
            top = self._sbrk(0) or 0
            # Below the last refill's top the pages are in already (malloc gives a brk heap's
            # memory back only by lowering its top), so only the heap's growth is populated.
            start = max(self._floor, top - self._window, min(self._populated, top))
            start = start // _PAGE * _PAGE
            while start < top:
                length = min(_POPULATE_STEP, top - start)
                if self._madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                    error = ctypes.get_errno()
                    if error in (errno.EINTR, errno.EAGAIN):  # a signal; try that step again
                        continue
                    logger.info("the heap reserve stops: madvise failed (%s)", os.strerror(error))
                    return False
                start += length
            self._populated = top
            self.fills += 1
            return True

    def close(self) -> None:
        self._closed = True
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait(self._interval)
            self._wanted.clear()
            if self._closed or not self.fill():
                return


_active: HeapReserve | None = None


def reserve_heap(
    reserve: int = HEAP_RESERVE, top_pad: int = TOP_PAD, interval: float | None = 0.05
) -> HeapReserve | None:
    """Make every thread allocate from malloc's one heap and start a :class:`HeapReserve` on it.

    One heap (``M_ARENA_MAX`` 1), since its top is the one place all threads' new buffers come
    from; the threads' allocations are few and large, and the GIL serialises the rest. The
    reserve refills on :func:`make_room` and every ``interval`` seconds (None: only when asked).
    Call it before the threads that allocate start. Returns None where it cannot work: not
    glibc, no heap, a kernel without ``MADV_POPULATE_WRITE``.
    """
    global _active
    libc = _libc()
    floor = _heap_start()
    if libc is None or floor is None:
        return None
    heap = HeapReserve(libc, floor, reserve, top_pad, interval)
    if not heap.fill():  # the kernel cannot populate: leave malloc as it was
        return None
    heap.applied = _apply(libc, {_M_ARENA_MAX: 1, _M_TOP_PAD: top_pad})
    heap.start()
    if _active is not None:
        _active.close()
    _active = heap
    return heap


def make_room() -> None:
    """Wake the process's heap reserve, if one runs: a request is coming in."""
    if _active is not None:
        _active.make_room()


def _heap_start() -> int | None:
    """Where the process's brk heap begins (``[heap]`` in /proc/self/maps), None without one."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith("[heap]"):
                    return int(line.split("-", 1)[0], 16)
    except OSError:
        pass
    return None
