"""The serving process's allocator: freed megabyte buffers kept for the next request
(:func:`~mmproc.malloc_settings.keep_freed_memory`, re-exported here), and the heap's top
faulted in ahead of the requests.

What a request keeps is new memory all the same: the processor's cache holds every new item's
outputs (megabytes per picture) until it is full. Faulting those pages in on the request's path
costs as much as decoding its JPEG, and concurrent faults of one process contend in the kernel.
:func:`reserve_heap` starts a thread that keeps the top of malloc's one heap faulted in ahead of
the requests (``madvise(MADV_POPULATE_WRITE)``, which maps pages without touching what they
hold, so it is safe on memory in use), woken by :func:`make_room` as each request comes in.

Only ``mmproc serve`` calls these: a library must not change its host process's allocator. A
setting the operator made with glibc's own environment variables (``MALLOC_ARENA_MAX``,
``MALLOC_TOP_PAD_``, those of :mod:`mmproc.malloc_settings`) or ``GLIBC_TUNABLES`` is left as
they set it. Elsewhere than glibc they do nothing.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading

from mmproc.malloc_settings import (
    M_ARENA_MAX,
    M_TOP_PAD,
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
    apply_malloc_settings,
    glibc,
    keep_freed_memory,
)

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

_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_POPULATE_STEP = 4 << 20  # bytes per madvise call: allocations go on between them

#: Free, faulted-in bytes :func:`reserve_heap` keeps at the heap's top: several pictures'
#: outputs. Below :data:`MMAP_THRESHOLD`, so that reserving it takes heap memory.
HEAP_RESERVE = 24 << 20

#: How much more the heap grows each time it must (``M_TOP_PAD``): the reserve is refilled in
#: few, large steps.
TOP_PAD = 64 << 20


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
    libc = glibc()
    floor = _heap_start()
    if libc is None or floor is None:
        return None
    heap = HeapReserve(libc, floor, reserve, top_pad, interval)
    if not heap.fill():  # the kernel cannot populate: leave malloc as it was
        return None
    heap.applied = apply_malloc_settings(libc, {M_ARENA_MAX: 1, M_TOP_PAD: top_pad})
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
