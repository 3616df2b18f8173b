"""mmproc.cache: cached items, byte-bounded LRU, protection of a request's own entries, threads."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from mmproc.cache import (
    CACHE_BYTES_ENV,
    DEFAULT_CACHE_BYTES,
    STAND_IN_BYTES,
    CachedItem,
    CacheStats,
    ProcessorCache,
    compact_entry,
    entry_nbytes,
    parse_byte_size,
)
from mmproc.errors import ConfigurationError
from mmproc.prompt_update import PromptReplacement, resolve_prompt_updates


def _entry(nbytes: int = 100, fill: int = 0) -> CachedItem:
    return CachedItem.of({"pixel_values": np.full(nbytes, fill, np.uint8)})


def _keys(cache: ProcessorCache) -> list[str]:
    return list(cache._data)  # LRU order, least recent first


def test_miss_then_hit_and_stats() -> None:
    cache = ProcessorCache(1000)
    assert cache.lookup(["a"]) == [None]
    assert cache.put("a", _entry(fill=7))
    (hit,) = cache.lookup(["a"])
    assert hit is not None
    assert hit.data["pixel_values"][0] == 7
    assert "a" in cache
    assert len(cache) == 1
    stats = cache.stats()
    assert stats == CacheStats(
        hits=1, misses=1, inserts=1, evictions=0, rejected=0, entries=1, nbytes=100, max_bytes=1000
    )
    assert stats.hit_rate == 0.5
    assert ProcessorCache(10).stats().hit_rate == 0.0


def test_a_retried_lookup_turns_misses_into_hits_once() -> None:
    cache = ProcessorCache(1000)
    assert cache.lookup(["a", "b", "a"]) == [None, None, None]
    assert cache.lookup(["a", "b", "a"], retry=True) == [None, None, None]
    assert (cache.stats().hits, cache.stats().misses) == (0, 3)  # not counted twice
    cache.put("a", _entry())
    found = cache.lookup(["a", "b", "a"], retry=True)  # another request computed "a" meanwhile
    assert [entry is not None for entry in found] == [True, False, True]
    assert (cache.stats().hits, cache.stats().misses) == (2, 1)


def test_get_is_a_lookup_of_one_key() -> None:
    cache = ProcessorCache(1000)
    cache.put("a", _entry())
    assert [e is not None for e in cache.lookup(["a", "b", "a"])] == [True, False, True]
    assert cache.get("b") is None
    assert cache.get("a") is cache.lookup(["a"])[0]


def test_lru_eviction_by_bytes() -> None:
    cache = ProcessorCache(300)
    for key in "abc":
        cache.put(key, _entry(100))
    cache.lookup(["a"])  # a becomes most recent: b is now the oldest
    cache.put("d", _entry(100))
    assert _keys(cache) == ["c", "a", "d"]
    cache.put("big", _entry(250))  # needs 250: evicts c, a and d
    assert _keys(cache) == ["big"]
    assert cache.nbytes == 250
    assert cache.stats().evictions == 4


def test_entries_of_different_sizes_count_their_bytes() -> None:
    cache = ProcessorCache(1000)
    entry = {
        "pixel_values": torch.zeros(10, 6, dtype=torch.float32),
        "image_grid_thw": torch.tensor([1, 2, 5]),
        "meta": [np.zeros(4, np.float64), b"abcd"],
    }
    expected = 240 + 24 + 32 + 4
    assert entry_nbytes(entry) == expected
    cache.put("a", CachedItem.of(entry))
    assert cache.nbytes == expected
    cache.put("b", CachedItem.of({"v": np.zeros(10)}, nbytes=500))  # an explicit size is trusted
    assert cache.nbytes == expected + 500


def test_a_request_never_evicts_its_own_hits() -> None:
    cache = ProcessorCache(300)
    for key in "abc":
        cache.put(key, _entry(100))
    request = ["a", "x", "y"]
    hits = cache.lookup(request)
    assert [h is not None for h in hits] == [True, False, False]
    # Another request runs in between and makes a the least recently used entry again.
    cache.lookup(["b", "c"])
    assert _keys(cache)[0] == "a"
    assert cache.insert({"x": _entry(100), "y": _entry(100)}, protect=request) == 2
    assert sorted(_keys(cache)) == ["a", "x", "y"]


def test_new_entries_that_only_fit_by_evicting_hits_are_not_cached() -> None:
    cache = ProcessorCache(300)
    for key in "abc":
        cache.put(key, _entry(100))
    request = ["a", "b", "c", "d"]
    cache.lookup(request)
    assert cache.insert({"d": _entry(100)}, protect=request) == 0
    assert sorted(_keys(cache)) == ["a", "b", "c"]
    assert cache.stats().rejected == 1
    assert cache.stats().evictions == 0


def test_a_call_never_evicts_what_it_inserted() -> None:
    cache = ProcessorCache(250)
    cache.put("old", _entry(100))
    assert cache.insert([("x", _entry(100)), ("y", _entry(100)), ("z", _entry(100))]) == 2
    assert _keys(cache) == ["x", "y"]
    assert cache.stats().rejected == 1


def test_an_item_larger_than_the_cache_is_not_cached() -> None:
    cache = ProcessorCache(300)
    cache.put("a", _entry(100))
    assert not cache.put("huge", _entry(301))
    assert _keys(cache) == ["a"]  # and nothing was evicted for it
    stats = cache.stats()
    assert (stats.rejected, stats.evictions) == (1, 0)
    assert cache.put("exact", _entry(300))


def test_zero_disables() -> None:
    cache = ProcessorCache(0)
    assert not cache.enabled
    assert not cache.put("a", _entry())
    assert cache.insert({"a": _entry()}) == 0
    assert cache.lookup(["a"]) == [None]
    assert len(cache) == 0
    assert cache.nbytes == 0


def test_existing_key_is_touched_not_replaced() -> None:
    cache = ProcessorCache(300)
    cache.put("a", _entry(100, fill=1))
    cache.put("b", _entry(100))
    assert cache.put("a", _entry(100, fill=2))
    assert _keys(cache) == ["b", "a"]
    assert cache.get("a").data["pixel_values"][0] == 1  # type: ignore[union-attr]
    assert cache.nbytes == 200


def test_a_cached_item_is_read_only_and_keeps_its_prompt_updates() -> None:
    original = {"pixel_values": np.zeros(4, np.uint8)}
    updates = resolve_prompt_updates([PromptReplacement("image", [5], [5, 5])], {"image": 1})
    item = CachedItem.of(original, updates["image"][0])
    original["extra"] = 1  # the caller's dict is not the stored one
    assert set(item.data) == {"pixel_values"}
    with pytest.raises(TypeError):
        item.data["other"] = 2  # type: ignore[index]
    assert [u.content.full for u in item.prompt_updates] == [(5, 5)]
    cache = ProcessorCache(300)
    cache.put("a", item)
    assert cache.get("a") is item  # shared, not copied: nothing can change it


def _pixels_and_grid(fill: int = 3) -> CachedItem:
    updates = resolve_prompt_updates([PromptReplacement("image", [5], [5, 5])], {"image": 1})
    data = {
        "pixel_values": torch.full((64, 1176), fill, dtype=torch.uint8),
        "patches": np.full((32, 64), fill, np.float32),
        "image_grid_thw": torch.tensor([[1, 8, 8]]),
    }
    return CachedItem.of(data, updates["image"][0])


def test_a_stand_in_gives_meta_tensors_for_big_outputs_and_the_values_of_small_ones() -> None:
    item = _pixels_and_grid()
    stand_in = item.as_stand_in()
    assert stand_in.stand_in and not item.stand_in
    assert stand_in.nbytes == STAND_IN_BYTES < item.nbytes
    data = stand_in.feature_data()
    for name in ("pixel_values", "patches"):
        assert data[name].is_meta and tuple(data[name].shape) == tuple(item.data[name].shape)
    assert data["pixel_values"].dtype == torch.uint8
    assert data["patches"].dtype == torch.float32  # numpy's dtype, as torch names it
    grid = data["image_grid_thw"]
    assert torch.equal(grid, item.data["image_grid_thw"]) and grid.dtype == torch.int64
    assert stand_in.prompt_updates == item.prompt_updates
    assert item.feature_data() is item.data  # a whole item's outputs as they are


def test_a_stand_in_keeps_no_tensor_or_array_alive_only_plain_descriptions() -> None:
    # Tensors and arrays are C allocations: kept long amid transient megabytes, each would pin
    # a fragment of the heap, which would then grow with every new item.
    updates = resolve_prompt_updates([PromptReplacement("image", [5], [5, 5])], {"image": 1})
    small = np.arange(6, dtype=np.int32).reshape(2, 3)
    item = CachedItem.of(
        {"pixel_values": torch.zeros(4096, dtype=torch.uint8), "sizes": small, "n": 3},
        updates["image"][0],
    )
    stand_in = item.as_stand_in()
    assert not [
        name
        for name, value in stand_in.data.items()
        if isinstance(value, torch.Tensor | np.ndarray)
    ]
    restored = stand_in.feature_data()
    assert restored["n"] == 3
    assert restored["sizes"].dtype == np.int32 and (restored["sizes"] == small).all()


def test_keeping_a_stand_in_swaps_the_item_in_place_and_frees_its_bytes() -> None:
    cache = ProcessorCache(1 << 20)
    for key in "abc":
        cache.put(key, _pixels_and_grid())
    full = cache.get("b")
    assert full is not None
    before = cache.nbytes
    assert cache.keep_stand_in("b", full.data)
    assert _keys(cache) == ["a", "c", "b"]  # where the lookup left it: not moved by the swap
    held = cache.get("b")
    assert held is not None and held.stand_in
    assert held.feature_data()["pixel_values"].is_meta
    assert cache.nbytes == before - full.nbytes + STAND_IN_BYTES
    assert cache.stats().stand_ins == 1
    assert not cache.keep_stand_in("b", held.data)  # a stand-in already


def test_a_stand_in_is_only_kept_for_the_very_item_a_feature_came_from() -> None:
    cache = ProcessorCache(1 << 20)
    cache.put("a", _pixels_and_grid())
    other = _pixels_and_grid()  # same content, another mapping: not what the cache holds
    assert not cache.keep_stand_in("a", other.data)
    assert not cache.keep_stand_in("missing", other.data)
    held = cache.get("a")
    assert held is not None and not held.stand_in and cache.stats().stand_ins == 0


def test_dropping_a_stand_in_forgets_it_and_leaves_whole_items_alone() -> None:
    cache = ProcessorCache(1 << 20)
    cache.put("a", _pixels_and_grid())
    cache.put("b", _pixels_and_grid())
    a = cache.get("a")
    assert a is not None and cache.keep_stand_in("a", a.data)
    assert not cache.drop_stand_in("b")  # whole: kept
    assert cache.drop_stand_in("a")
    assert _keys(cache) == ["b"] and cache.stats().stand_ins == 0
    assert cache.nbytes == _pixels_and_grid().nbytes
    assert not cache.drop_stand_in("a")


def test_a_whole_item_computed_again_replaces_its_stand_in() -> None:
    cache = ProcessorCache(1 << 20)
    cache.put("a", _pixels_and_grid())
    a = cache.get("a")
    assert a is not None and cache.keep_stand_in("a", a.data)
    again = _pixels_and_grid(fill=9)
    assert cache.put("a", again)
    assert cache.get("a") is again and cache.stats().stand_ins == 0
    assert cache.nbytes == again.nbytes


def test_evicting_a_stand_in_counts_it_out() -> None:
    room = _pixels_and_grid().nbytes + STAND_IN_BYTES
    cache = ProcessorCache(room)
    cache.put("a", _pixels_and_grid())
    a = cache.get("a")
    assert a is not None and cache.keep_stand_in("a", a.data)
    cache.put("b", _pixels_and_grid())
    assert cache.stats().stand_ins == 1  # both fit: the stand-in costs its charge only
    cache.put("c", _pixels_and_grid())
    stats = cache.stats()
    assert _keys(cache) == ["c"] and stats.stand_ins == 0 and stats.evictions == 2


def test_views_of_a_batch_are_stored_compact() -> None:
    batch = torch.arange(100 * 4, dtype=torch.float32).reshape(100, 4)
    parts = batch.split([10, 90])
    cache = ProcessorCache(10_000)
    cache.insert(
        {
            "a": CachedItem.of({"pv": parts[0]}, compact=True),
            "b": CachedItem.of({"pv": parts[1]}, compact=True),
        }
    )
    stored_a = cache.get("a").data["pv"]  # type: ignore[union-attr]
    assert torch.equal(stored_a, parts[0])
    assert stored_a.untyped_storage().nbytes() == stored_a.nbytes == 160
    assert stored_a.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    assert cache.nbytes == 400 * 4


def test_compact_keeps_owning_values_without_copy() -> None:
    tensor = torch.zeros(10, 4)
    array = np.zeros(10)
    view = np.zeros(100)[10:20]
    strided = torch.zeros(4, 10).t()
    compact = compact_entry({"t": tensor, "a": array, "v": view, "s": strided, "n": 3})
    assert compact["t"] is tensor
    assert compact["a"] is array
    assert compact["v"] is not view and compact["v"].base is None
    assert np.array_equal(compact["v"], view)
    assert compact["s"].is_contiguous() and torch.equal(compact["s"], strided)
    assert compact["n"] == 3
    assert CachedItem.of({"v": view}).data["v"] is view  # not meant for the cache: no copy


def test_clear() -> None:
    cache = ProcessorCache(300)
    cache.put("a", _entry())
    cache.clear()
    assert len(cache) == 0
    assert cache.nbytes == 0
    assert cache.stats().inserts == 1


def test_size_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_BYTES_ENV, raising=False)
    assert ProcessorCache().max_bytes == DEFAULT_CACHE_BYTES == 4 << 30
    monkeypatch.setenv(CACHE_BYTES_ENV, "512MiB")
    assert ProcessorCache().max_bytes == 512 << 20
    assert ProcessorCache(1000).max_bytes == 1000  # an explicit bound wins
    monkeypatch.setenv(CACHE_BYTES_ENV, "0")
    assert not ProcessorCache().enabled
    monkeypatch.setenv(CACHE_BYTES_ENV, "lots")
    with pytest.raises(ConfigurationError, match=CACHE_BYTES_ENV):
        ProcessorCache()


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("4294967296", 4 << 30),
        ("4GiB", 4 << 30),
        ("4G", 4 << 30),
        ("2GB", 2 * 10**9),
        (" 512 mib ", 512 << 20),
        ("1.5KiB", 1536),
        ("100b", 100),
    ],
)
def test_parse_byte_size(text: str, value: int) -> None:
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "4 parsecs", "1e9", "GiB"])
def test_parse_byte_size_rejects(text: str) -> None:
    with pytest.raises(ConfigurationError):
        parse_byte_size(text)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4GiB"])
def test_bad_max_bytes(bad: Any) -> None:
    with pytest.raises(ConfigurationError):
        ProcessorCache(bad)


def test_concurrent_requests_from_threads() -> None:
    cache = ProcessorCache(2000)
    n_threads, n_requests = 8, 1000
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []
    lookups = [0] * n_threads

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            barrier.wait()
            for _ in range(n_requests):
                keys = [f"k{rng.randrange(40)}" for _ in range(rng.randrange(1, 5))]
                hits = cache.lookup(keys)
                lookups[tid] += len(keys)
                new = {
                    k: _entry(rng.randrange(50, 400), fill=int(k[1:]))
                    for k, h in zip(keys, hits, strict=True)
                    if h is None
                }
                cache.insert(new, protect=keys)
                for k, h in zip(keys, hits, strict=True):
                    # Content addressing: whatever is cached under a key has that key's content.
                    if h is not None and h.data["pixel_values"][0] != int(k[1:]):
                        raise AssertionError(f"wrong entry for {k}")
                assert cache.nbytes <= cache.max_bytes
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = cache.stats()
    assert stats.hits + stats.misses == sum(lookups)
    assert stats.nbytes == sum(item.nbytes for item in cache._data.values()) <= 2000
    assert stats.entries == len(cache)
    assert stats.hits > 0 and stats.evictions > 0
