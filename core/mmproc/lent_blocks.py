"""Outputs read out of a worker process's shared memory without a copy: blocks lent to tensors.

A worker writes a call's outputs into a block the serving process names. Copying them out again
is the serving process's largest cost of a call after hashing the items, and callers hold
outputs for a while (the cache, a batch of results, the engine's queue). So besides the block
its outputs are copied out of (its :class:`~mmproc.shared_blocks.KeptBlock`), each worker has
blocks that are lent: the tensors read out of one are views of its memory, and it is named to
the worker again only once the last of them is gone (a finalizer on the buffer they share).

Lent blocks are bounded: at most ``LENDABLE_BLOCKS`` and ``LENDABLE_BYTES`` of them per worker
(each keeps a file descriptor open), and none is made that would leave less than
``SHM_HEADROOM`` of shared memory free (a container's small ``/dev/shm`` stays for the workers'
own blocks). Past a bound, outputs are copied out as before.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref

from mmproc.errors import WorkerProcessError
from mmproc.shared_blocks import KEPT_BLOCK_MAX, KeptBlock, drop_block

__all__ = ["LENDABLE_BLOCKS", "LENDABLE_BYTES", "SHM_HEADROOM", "LendableBlocks"]

#: Blocks per worker that outputs read without a copy may hold at once.
LENDABLE_BLOCKS = 16

#: Shared memory per worker that outputs read without a copy may hold: a few dozen pictures'.
LENDABLE_BYTES = 128 << 20

#: Shared memory a new lent block must leave free.
SHM_HEADROOM = 32 << 20

_SHM_DIR = "/dev/shm"


def shared_memory_free() -> int | None:
    """Bytes free in shared memory, where the system says (None elsewhere)."""
    try:
        stats = os.statvfs(_SHM_DIR)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


class LendableBlocks:
    """One worker's blocks that outputs are read from without a copy.

    :meth:`take` gives the block for a call (one free, or a new one the size the outputs are
    expected to take); :meth:`lend` makes the buffer its outputs' tensors share; :meth:`give_back`
    returns one the call did not lend. A lent block comes back by itself once its outputs are
    gone. ``take`` and ``give_back`` are called by the one call that holds the worker; lent
    blocks come back from whichever thread drops the last tensor, so their return only queues
    them. :meth:`forgotten` names the blocks dropped since it was last asked, for the worker to
    unmap.
    """

    def __init__(
        self, worker_index: int, *, count: int | None = None, budget: int | None = None
    ) -> None:
        self._index = worker_index
        self._count = LENDABLE_BLOCKS if count is None else count
        self._budget = LENDABLE_BYTES if budget is None else budget
        self._lock = threading.Lock()
        self._made = 0
        self._blocks = 0  # not dropped: free, taken or lent
        self._bytes = 0  # of every block not dropped: free, taken or lent
        self._free: list[KeptBlock] = []
        self._lent: set[KeptBlock] = set()
        self._returned: collections.deque[KeptBlock] = collections.deque()
        self._dropped: list[str] = []
        self._closed = False

    def take(self, expected: int) -> KeptBlock | None:
        """A block of at least ``expected`` bytes for a call's outputs, or None (no size known
        yet, the budget lent, no shared memory to spare): the call's outputs are copied out of
        the worker's own block then."""
        with self._lock:
            self._collect()
            if self._closed or expected <= 0:
                return None
            while self._free:  # the most recently used first: mapped, and in the caches
                box = self._free.pop()
                if box.block is not None and box.block.size >= expected:
                    return box
                self._drop(box)  # smaller than what comes now
            return self._new(expected)

    def _new(self, expected: int) -> KeptBlock | None:
        size = max(expected + 1, int(expected * 1.25))  # as KeptBlock.fitted makes it
        if self._blocks >= self._count or expected > KEPT_BLOCK_MAX:
            return None
        if self._bytes + size > self._budget:
            return None
        free = shared_memory_free()
        if free is not None and free - size < SHM_HEADROOM:
            return None
        box = KeptBlock(self._index, f"lent{self._made}")
        self._made += 1
        try:
            box.fitted(expected)
        except WorkerProcessError:
            return None  # no shared memory for one more after all
        assert box.block is not None
        self._blocks += 1
        self._bytes += box.block.size
        return box

    def give_back(self, box: KeptBlock) -> None:
        """Return a block taken for a call that did not lend it (its outputs did not fit, or the
        call failed)."""
        with self._lock:
            self._collect()
            if box in self._lent or box in self._free:
                return  # lent after all (a read that failed after lend): it comes back itself
            if self._closed:
                self._drop(box)
            else:
                self._free.append(box)

    def lend(self, box: KeptBlock) -> memoryview:
        """The buffer that the outputs read out of ``box`` share; ``box`` is free again once
        the buffer, and so every tensor made from it, is gone."""
        assert box.block is not None and box.block.buf is not None  # a block take() gave
        buffer = memoryview(box.block.buf)
        with self._lock:
            self._lent.add(box)
        weakref.finalize(buffer, self._returned_by_outputs, box).atexit = False
        return buffer

    def _returned_by_outputs(self, box: KeptBlock) -> None:
        # Any thread, while it drops the last tensor (even inside take, for a collection that
        # ran there): queued only; taken in by take, or dropped here once closed.
        self._returned.append(box)
        if self._closed:
            self._drop_returned()

    def _collect(self) -> None:
        while self._returned:
            box = self._returned.popleft()
            self._lent.discard(box)
            self._free.append(box)

    def _drop(self, box: KeptBlock) -> None:
        if box.block is not None:
            self._blocks -= 1
            self._bytes -= box.block.size
            self._dropped.append(box.block.name)
        box.drop()

    def _drop_returned(self) -> None:
        while True:
            try:
                box = self._returned.popleft()
            except IndexError:
                return
            box.drop()

    def forgotten(self) -> list[str]:
        """The names of the blocks dropped since the last call: the worker unmaps them."""
        with self._lock:
            names, self._dropped = self._dropped, []
        return names

    @property
    def names(self) -> list[str]:
        """The blocks in shared memory: free, and lent to outputs still held."""
        with self._lock:
            self._collect()
            boxes = [*self._free, *self._lent]
        return [box.block.name for box in boxes if box.block is not None]

    @property
    def lent(self) -> int:
        """How many blocks outputs still hold."""
        with self._lock:
            self._collect()
            return len(self._lent)

    def close(self) -> None:
        """Unlink every block: the free ones go now; a lent one stays mapped, its outputs
        intact, until they are gone."""
        self._closed = True  # first: a block returned from now on is dropped by its return
        with self._lock:
            self._collect()
            free, lent = self._free, self._lent
            self._free, self._lent = [], set()
            for box in free:
                self._drop(box)
        for box in lent:  # its name goes now, its memory with its last view
            if box.block is not None:
                drop_block(box.block)
        self._drop_returned()
