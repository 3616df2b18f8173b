"""The processor-output cache: each item's outputs and prompt update by key, bounded in bytes, LRU.

A :class:`CachedItem` is one media item as the processor produced it: its per-item outputs (what
:func:`mmproc.fields.split_outputs` gives) and its resolved prompt updates
(:class:`~mmproc.prompt_update.ResolvedPromptUpdate`), so a request whose items all hit needs
neither the HF processor nor the model's hooks. Keys come from :mod:`mmproc.cache_keys`. The
pipeline uses the cache once per request, in two calls::

    hits = cache.lookup(keys)             # one lock: every hit becomes most recently used
    ...                                   # run the HF processor on the misses only
    cache.insert(new_items, protect=keys)

Why a request never evicts its own hits: ``insert`` first moves every key in ``protect`` that is
still cached to the most-recently-used end (other requests may have run since ``lookup``), then
evicts strictly from the least-recently-used end, and never evicts a protected key or an item
inserted by the same call — an item that would need that is simply not cached (counted in
``stats().rejected``). Likewise an item larger than the whole cache is not cached.

Sizes: an item's size is the sum of its arrays' and tensors' ``nbytes`` (other leaves count
``sys.getsizeof``). A per-item slice of a batched tensor keeps the whole batch's memory alive, so
items meant for the cache are made with ``CachedItem.of(..., compact=True)``, which stores such
views as compact copies; otherwise the byte bound would not bound memory. Cached items are
immutable and shared, their ``data`` a read-only mapping: treat the tensors as read-only too.

Stand-ins: a front end whose engine holds an item's tensors (it said so, `mmproc.wire`) needs
only the item's metadata to send it again by reference. :meth:`ProcessorCache.keep_stand_in`
swaps such an item for its *stand-in* (:meth:`CachedItem.as_stand_in`: its tensors' dtypes and
shapes, and the values of small ones, as plain Python objects; a hit's features get ``torch``
meta tensors, dtype and shape without memory, for the big ones), which keeps its place in the
LRU order and is charged `STAND_IN_BYTES`; the memory goes back to the allocator, so new items
reuse it instead of costing fresh pages. A stand-in hit gives a feature that can only go by
reference; should the engine lack it after all, :meth:`ProcessorCache.drop_stand_in` forgets
it, and the request is processed again.

The bound: ``ProcessorCache(max_bytes)``; ``None`` reads ``MMPROC_CACHE_BYTES`` (an integer, or
with a unit: ``512MiB``, ``4GiB``, ``2GB``) and falls back to 4 GiB; ``0`` disables the cache.
All methods are thread-safe (one lock; copying and sizing happen before it, in ``CachedItem.of``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from mmproc._torch import is_torch_tensor
from mmproc.errors import ConfigurationError

if TYPE_CHECKING:
    from mmproc.prompt_update import ResolvedPromptUpdate

__all__ = [
    "CACHE_BYTES_ENV",
    "DEFAULT_CACHE_BYTES",
    "STAND_IN_BYTES",
    "CacheStats",
    "CachedItem",
    "ProcessorCache",
    "compact_entry",
    "entry_nbytes",
    "parse_byte_size",
]

DEFAULT_CACHE_BYTES = 4 << 30
"""The default bound: 4 GiB."""

STAND_IN_BYTES = 2048
"""What a stand-in entry is charged: its Python objects (prompt updates, the descriptions of its
tensors), for which no tensor's ``nbytes`` stands any more."""

# A stand-in keeps the values of tensors and arrays smaller than this (grids and the like:
# cheap, and readable by whoever looks at the feature); bigger ones come back as meta tensors.
_STAND_IN_MIN_BYTES = 1024

CACHE_BYTES_ENV = "MMPROC_CACHE_BYTES"
"""Environment variable read when ``ProcessorCache(max_bytes=None)``."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

Entry = Mapping[str, Any]


def parse_byte_size(text: str, *, name: str = CACHE_BYTES_ENV) -> int:
    """Parse ``"4294967296"``, ``"4GiB"``, ``"512 MiB"``, ``"2GB"`` (K/M/G/T alone are binary).

    Raises:
        ConfigurationError: not a non-negative size; the message names ``name``.
    """
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigurationError(
            f"{name}={text!r} is not a byte size (e.g. 4294967296, 4GiB, 512MiB, 2GB, 0)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _value_nbytes(value: Any) -> int:
    if is_torch_tensor(value) or isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value) if not isinstance(value, memoryview) else value.nbytes
    if isinstance(value, Mapping):
        return sum(_value_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_value_nbytes(v) for v in value)
    return sys.getsizeof(value)


def entry_nbytes(entry: Entry) -> int:
    """Return the bytes an entry holds: array and tensor ``nbytes``, recursively."""
    return sum(_value_nbytes(v) for v in entry.values())


def _root_nbytes(arr: np.ndarray) -> int:
    base: Any = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    try:
        return memoryview(base).nbytes
    except TypeError:
        return int(arr.nbytes)


def _compact_value(value: Any) -> Any:
    if is_torch_tensor(value):
        import torch

        if value.untyped_storage().nbytes() > value.nbytes or not value.is_contiguous():
            return value.clone(memory_format=torch.contiguous_format)
        return value
    if isinstance(value, np.ndarray):
        if value.base is not None and (
            _root_nbytes(value) > value.nbytes or not value.flags.c_contiguous
        ):
            return np.array(value, order="C", copy=True)
        return value
    if isinstance(value, list):
        return [_compact_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_compact_value(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class _Described:
    """What a stand-in keeps of a tensor or array, in plain Python objects: a big one's dtype
    and shape (it comes back as a meta tensor), a small one's values too.

    Plain Python objects because a stand-in lives long: tensors (meta ones included) and arrays
    are C allocations, made amid a request's megabytes of transient buffers, and a small one
    kept there stops malloc from merging the freed space around it, so the heap would grow by
    a fragment with every new item."""

    numpy: bool  # a small numpy array (big ones come back as torch meta tensors)
    dtype: Any  # a torch dtype, or a small array's numpy dtype string
    shape: tuple[int, ...]
    values: Any = None  # a small one's, as nested lists; None: a big one

    def restored(self) -> Any:
        import torch

        if self.values is None:
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        if self.numpy:
            return np.array(self.values, dtype=self.dtype).reshape(self.shape)
        return torch.tensor(self.values, dtype=self.dtype).reshape(self.shape)


def _described(value: Any) -> Any:
    small = getattr(value, "nbytes", 0) < _STAND_IN_MIN_BYTES
    if is_torch_tensor(value):
        values = value.tolist() if small and not value.is_meta else None
        return _Described(False, value.dtype, tuple(value.shape), values)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biufc":
        return value  # strings, objects: no tensor the wire sends
    if small:
        return _Described(True, value.dtype.str, value.shape, value.tolist())
    import torch

    try:
        dtype = torch.from_numpy(np.empty(0, value.dtype)).dtype
    except TypeError:
        return value  # a dtype torch lacks (big-endian): kept as it is
    return _Described(False, dtype, value.shape)


def compact_entry(entry: Entry) -> dict[str, Any]:
    """Return ``entry`` with every view of a larger buffer replaced by a compact copy.

    Tensors and arrays that own exactly their bytes are kept as they are (no copy).
    """
    return {k: _compact_value(v) for k, v in entry.items()}


@dataclass(frozen=True, slots=True, eq=False)
class CachedItem:
    """One item's processor outputs and resolved prompt updates, as the cache keeps them.

    ``data`` maps output names to the item's own values (read-only); ``prompt_updates`` are the
    item's candidate updates in the order the model gave them; ``nbytes`` its size in the cache.
    Build one with :meth:`of`.
    """

    data: Mapping[str, Any]
    prompt_updates: tuple[ResolvedPromptUpdate, ...]
    nbytes: int
    stand_in: bool = False
    """It keeps only descriptions of its tensors (see the module docs and `feature_data`): it
    can only go by reference."""

    @classmethod
    def of(
        cls,
        data: Entry,
        prompt_updates: Sequence[ResolvedPromptUpdate] = (),
        *,
        compact: bool = False,
        nbytes: int | None = None,
    ) -> CachedItem:
        """An item from its outputs; ``compact`` copies views of larger buffers (for caching),
        ``nbytes`` overrides the computed size."""
        stored = compact_entry(data) if compact else dict(data)
        size = entry_nbytes(stored) if nbytes is None else int(nbytes)
        return cls(MappingProxyType(stored), tuple(prompt_updates), size)

    def as_stand_in(self) -> CachedItem:
        """This item as a stand-in, charged `STAND_IN_BYTES`: its tensors and arrays kept as
        descriptions, which `feature_data` turns back into values, those of 1 KiB and more
        into ``torch`` meta tensors of the same dtype and shape."""
        stored = {key: _described(value) for key, value in self.data.items()}
        return CachedItem(MappingProxyType(stored), self.prompt_updates, STAND_IN_BYTES, True)

    def feature_data(self) -> Mapping[str, Any]:
        """The item's outputs for a feature: ``data`` itself, or for a stand-in, values made
        from its descriptions now (meta tensors for the big ones), the request's own."""
        if not self.stand_in:
            return self.data
        return MappingProxyType(
            {
                key: value.restored() if isinstance(value, _Described) else value
                for key, value in self.data.items()
            }
        )


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a cache's counters: :meth:`ProcessorCache.stats`, which a processor offers
    as ``processor.cache.stats()``.

    The counters only grow over the cache's life (:meth:`ProcessorCache.clear` drops entries,
    not counts), so a test or a dashboard compares two snapshots::

        before = processor.cache.stats()
        processor.process(prompt, {"image": [image]})
        assert processor.cache.stats().hits == before.hits + 1  # served from the cache

    ``entries``, ``nbytes`` and ``max_bytes`` say what the cache holds at the snapshot.
    """

    hits: int
    """Keys found by lookups: one per cached item of a request (a retry that finds a key that
    missed before turns that miss into a hit)."""
    misses: int
    """Keys not found by lookups: the items a request had to compute."""
    inserts: int
    """Items cached."""
    evictions: int
    """Items dropped to make room, least recently used first."""
    rejected: int
    """Entries not cached: larger than the cache, or only fitting by evicting protected ones."""
    entries: int
    """Items held at the snapshot."""
    nbytes: int
    """Bytes those items hold (their arrays' and tensors' ``nbytes``)."""
    max_bytes: int
    """The bound in bytes (the ``cache_bytes`` option; 0: the cache is off)."""
    stand_ins: int = 0
    """Of those items, how many are stand-ins (their tensors held by an engine)."""

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0.0 before any lookup)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ProcessorCache:
    """Thread-safe LRU cache of :class:`CachedItem` by key, bounded by total bytes.

    Args:
        max_bytes: The bound; ``0`` disables caching; ``None`` reads ``MMPROC_CACHE_BYTES`` and
            defaults to 4 GiB.

    Raises:
        ConfigurationError: a negative bound or an unparsable ``MMPROC_CACHE_BYTES``.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is None:
            env = os.environ.get(CACHE_BYTES_ENV, "").strip()
            max_bytes = parse_byte_size(env) if env else DEFAULT_CACHE_BYTES
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigurationError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        # key -> item; order is recency, least recently used first.
        self._data: OrderedDict[str, CachedItem] = OrderedDict()
        self._nbytes = 0
        self._stand_ins = 0
        self._hits = self._misses = self._inserts = self._evictions = self._rejected = 0

    @property
    def max_bytes(self) -> int:
        """The bound in bytes (0: disabled)."""
        return self._max_bytes

    @property
    def enabled(self) -> bool:
        """Whether anything can be cached."""
        return self._max_bytes > 0

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        """Membership without touching recency or counters."""
        return key in self._data

    def lookup(self, keys: Sequence[str], *, retry: bool = False) -> list[CachedItem | None]:
        """Return the item or ``None`` for each key, in order.

        Every hit is moved to the most-recently-used end, all under one lock acquisition, so a
        request's hits are the last candidates for eviction when its misses are inserted.
        ``retry=True`` looks again for keys that missed in an earlier lookup of the same request
        (another request may have computed them since): a hit then turns that miss into a hit in
        the statistics, and a miss is not counted twice.
        """
        out: list[CachedItem | None] = []
        with self._lock:
            data = self._data
            for key in keys:
                item = data.get(key)
                if item is not None:
                    data.move_to_end(key)
                out.append(item)
            hits = sum(1 for e in out if e is not None)
            self._hits += hits
            self._misses += -hits if retry else len(out) - hits
        return out

    def get(self, key: str) -> CachedItem | None:
        """Return one item (touching it) or ``None``."""
        return self.lookup([key])[0]

    def put(self, key: str, item: CachedItem) -> bool:
        """Insert one item; return whether it is cached now (see :meth:`insert`)."""
        return self.insert({key: item}) == 1

    def insert(
        self,
        items: Mapping[str, CachedItem] | Iterable[tuple[str, CachedItem]],
        *,
        protect: Iterable[str] = (),
    ) -> int:
        """Insert items, evicting least recently used ones; return how many are cached now.

        Args:
            items: ``key -> item`` or ``(key, item)`` pairs. A key already cached keeps its item
                and is touched (keys name content: same key, same content), unless it holds a
                stand-in and the new item is whole: that replaces it.
            protect: Keys that must survive this call (the request's own keys): touched first,
                never evicted by it. Items inserted by this call are protected the same way.
        """
        if not self.enabled:
            return 0
        prepared = list(items.items() if isinstance(items, Mapping) else items)

        cached = 0
        with self._lock:
            data = self._data
            pinned: set[str] = set()
            pinned_bytes = 0
            for key in protect:
                held = data.get(key)
                if held is not None and key not in pinned:
                    data.move_to_end(key)
                    pinned.add(key)
                    pinned_bytes += held.nbytes
            for key, item in prepared:
                held = data.get(key)
                if held is not None and held.stand_in and not item.stand_in:
                    # The item computed again (its engine lacked it): the full one replaces it.
                    del data[key]
                    self._nbytes -= held.nbytes
                    self._stand_ins -= 1
                    held = None
                if held is not None:
                    data.move_to_end(key)
                    if key not in pinned:
                        pinned.add(key)
                        pinned_bytes += held.nbytes
                    cached += 1
                    continue
                nbytes = item.nbytes
                # Unpinned entries all precede pinned ones (pinned keys were moved to the end), so
                # evicting from the front frees up to max - pinned bytes without touching them.
                if nbytes > self._max_bytes - pinned_bytes:
                    self._rejected += 1
                    continue
                while self._nbytes + nbytes > self._max_bytes:
                    old_key = next(iter(data))
                    if old_key in pinned:  # unreachable by the invariant above; keep it honest
                        raise RuntimeError("ProcessorCache would evict a protected entry")
                    dropped = data.pop(old_key)
                    self._nbytes -= dropped.nbytes
                    self._stand_ins -= dropped.stand_in
                    self._evictions += 1
                data[key] = item
                self._nbytes += nbytes
                self._inserts += 1
                pinned.add(key)
                pinned_bytes += nbytes
                cached += 1
        return cached

    def keep_stand_in(self, key: str, data: Mapping[str, Any]) -> bool:
        """Swap the item cached under ``key`` for its stand-in (see the module docs), if it is
        still the item whose ``data`` that is (the very mapping a feature got from the cache);
        it keeps its place in the LRU order. Whether it was swapped."""
        with self._lock:
            held = self._data.get(key)
        if held is None or held.data is not data or held.stand_in:
            return False
        stand_in = held.as_stand_in()  # outside the lock: it allocates
        with self._lock:
            if self._data.get(key) is not held:
                return False  # evicted or replaced meanwhile
            self._data[key] = stand_in  # an existing key keeps its position
            self._nbytes += stand_in.nbytes - held.nbytes
            self._stand_ins += 1
        return True

    def drop_stand_in(self, key: str) -> bool:
        """Forget the stand-in cached under ``key`` (its engine lacks the item after all), so
        that the item is computed again; whether there was one. A full item is left alone."""
        with self._lock:
            held = self._data.get(key)
            if held is None or not held.stand_in:
                return False
            del self._data[key]
            self._nbytes -= held.nbytes
            self._stand_ins -= 1
        return True

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._data.clear()
            self._nbytes = 0
            self._stand_ins = 0

    def stats(self) -> CacheStats:
        """Return a consistent snapshot of the counters (all read under one lock): hits,
        misses, inserts, evictions, rejections, and the entries and bytes held now."""
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                inserts=self._inserts,
                evictions=self._evictions,
                rejected=self._rejected,
                entries=len(self._data),
                nbytes=self._nbytes,
                max_bytes=self._max_bytes,
                stand_ins=self._stand_ins,
            )
