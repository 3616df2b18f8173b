"""The processor-output cache: per-item processor outputs by content key, bounded in bytes, LRU.

Keys come from :mod:`mmproc.hashing` (``item_key(hash_context(...), hash_item(...))``); entries are
the per-item dicts that :func:`mmproc.fields.split_outputs` produces. The pipeline uses it once per
request, in two calls::

    keys = [item_key(ctx, hash_item(m, item)) for ...]
    hits = cache.lookup(keys)             # one lock: every hit becomes most recently used
    ...                                   # run the HF processor on the misses only, split per item
    cache.insert(new_entries, protect=keys)

Why a request never evicts its own hits: ``insert`` first moves every key in ``protect`` that is
still cached to the most-recently-used end (other requests may have run since ``lookup``), then
evicts strictly from the least-recently-used end, and never evicts a protected key or an entry
inserted by the same call — an entry that would need that is simply not cached (counted in
``stats().rejected``). Likewise an entry larger than the whole cache is not cached.

Sizes: an entry's size is the sum of its arrays' and tensors' ``nbytes`` (other leaves count
``sys.getsizeof``). A per-item slice of a batched tensor keeps the whole batch's memory alive, so
``insert`` stores such views as compact copies (``compact=True``, the default); otherwise the byte
bound would not bound memory. Entries handed out by ``lookup`` are shallow copies of the stored
dict, sharing the tensors: treat the tensors as read-only.

The bound: ``ProcessorCache(max_bytes)``; ``None`` reads ``MMPROC_CACHE_BYTES`` (an integer, or
with a unit: ``512MiB``, ``4GiB``, ``2GB``) and falls back to 4 GiB; ``0`` disables the cache.
All methods are thread-safe (one lock; copying and sizing happen outside it).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmproc._torch import is_torch_tensor
from mmproc.errors import ConfigurationError

__all__ = [
    "CACHE_BYTES_ENV",
    "DEFAULT_CACHE_BYTES",
    "CacheStats",
    "ProcessorCache",
    "compact_entry",
    "entry_nbytes",
    "parse_byte_size",
]

DEFAULT_CACHE_BYTES = 4 << 30
"""The default bound: 4 GiB."""

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


def compact_entry(entry: Entry) -> dict[str, Any]:
    """Return ``entry`` with every view of a larger buffer replaced by a compact copy.

    Tensors and arrays that own exactly their bytes are kept as they are (no copy).
    """
    return {k: _compact_value(v) for k, v in entry.items()}


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a cache's counters."""

    hits: int
    misses: int
    inserts: int
    evictions: int
    rejected: int
    """Entries not cached: larger than the cache, or only fitting by evicting protected ones."""
    entries: int
    nbytes: int
    max_bytes: int

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0.0 before any lookup)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ProcessorCache:
    """Thread-safe LRU cache of per-item processor outputs, bounded by total bytes.

    Args:
        max_bytes: The bound; ``0`` disables caching; ``None`` reads ``MMPROC_CACHE_BYTES`` and
            defaults to 4 GiB.
        compact: Store views of larger buffers as compact copies (see the module docstring).

    Raises:
        ConfigurationError: a negative bound or an unparsable ``MMPROC_CACHE_BYTES``.
    """

    def __init__(self, max_bytes: int | None = None, *, compact: bool = True) -> None:
        if max_bytes is None:
            env = os.environ.get(CACHE_BYTES_ENV, "").strip()
            max_bytes = parse_byte_size(env) if env else DEFAULT_CACHE_BYTES
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigurationError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self._max_bytes = max_bytes
        self._compact = compact
        self._lock = threading.Lock()
        # key -> (entry, nbytes); order is recency, least recently used first.
        self._data: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._nbytes = 0
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

    def lookup(self, keys: Sequence[str], *, retry: bool = False) -> list[dict[str, Any] | None]:
        """Return the entry (a shallow copy) or ``None`` for each key, in order.

        Every hit is moved to the most-recently-used end, all under one lock acquisition, so a
        request's hits are the last candidates for eviction when its misses are inserted.
        ``retry=True`` looks again for keys that missed in an earlier lookup of the same request
        (another request may have computed them since): a hit then turns that miss into a hit in
        the statistics, and a miss is not counted twice.
        """
        out: list[dict[str, Any] | None] = []
        with self._lock:
            data = self._data
            for key in keys:
                slot = data.get(key)
                if slot is None:
                    out.append(None)
                    continue
                data.move_to_end(key)
                out.append(dict(slot[0]))
            hits = sum(1 for e in out if e is not None)
            self._hits += hits
            self._misses += -hits if retry else len(out) - hits
        return out

    get_many = lookup

    def get(self, key: str) -> dict[str, Any] | None:
        """Return one entry (touching it) or ``None``."""
        return self.lookup([key])[0]

    def put(self, key: str, entry: Entry, nbytes: int | None = None) -> bool:
        """Insert one entry; return whether it is cached now (see :meth:`insert`)."""
        return self.insert([(key, entry, nbytes)]) == 1

    def insert(
        self,
        entries: Mapping[str, Entry] | Iterable[tuple[str, Entry] | tuple[str, Entry, int | None]],
        *,
        protect: Iterable[str] = (),
    ) -> int:
        """Insert entries, evicting least recently used ones; return how many are cached now.

        Args:
            entries: ``key -> entry``, or ``(key, entry)`` / ``(key, entry, nbytes)`` tuples
                (``nbytes`` ``None``: computed). A key already cached keeps its entry and is
                touched (keys are content hashes: same key, same content).
            protect: Keys that must survive this call (the request's own keys): touched first,
                never evicted by it. Entries inserted by this call are protected the same way.
        """
        if not self.enabled:
            return 0
        items = entries.items() if isinstance(entries, Mapping) else entries
        prepared: list[tuple[str, dict[str, Any], int]] = []
        # Copy and size outside the lock: clones can take milliseconds.
        for item in items:
            key, entry = item[0], item[1]
            nbytes = item[2] if len(item) > 2 else None  # type: ignore[misc]
            stored = compact_entry(entry) if self._compact else dict(entry)
            if nbytes is None:
                nbytes = entry_nbytes(stored)
            prepared.append((key, stored, int(nbytes)))

        cached = 0
        with self._lock:
            data = self._data
            pinned: set[str] = set()
            pinned_bytes = 0
            for key in protect:
                slot = data.get(key)
                if slot is not None and key not in pinned:
                    data.move_to_end(key)
                    pinned.add(key)
                    pinned_bytes += slot[1]
            for key, stored, nbytes in prepared:
                slot = data.get(key)
                if slot is not None:
                    data.move_to_end(key)
                    if key not in pinned:
                        pinned.add(key)
                        pinned_bytes += slot[1]
                    cached += 1
                    continue
                # Unpinned entries all precede pinned ones (pinned keys were moved to the end), so
                # evicting from the front frees up to max - pinned bytes without touching them.
                if nbytes > self._max_bytes - pinned_bytes:
                    self._rejected += 1
                    continue
                while self._nbytes + nbytes > self._max_bytes:
                    old_key = next(iter(data))
                    if old_key in pinned:  # unreachable by the invariant above; keep it honest
                        raise RuntimeError("ProcessorCache would evict a protected entry")
                    self._nbytes -= data.pop(old_key)[1]
                    self._evictions += 1
                data[key] = (stored, nbytes)
                self._nbytes += nbytes
                self._inserts += 1
                pinned.add(key)
                pinned_bytes += nbytes
                cached += 1
        return cached

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._data.clear()
            self._nbytes = 0

    def stats(self) -> CacheStats:
        """Return a consistent snapshot of the counters."""
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
            )
