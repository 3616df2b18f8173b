"""Benchmark content hashing and the processor cache's bookkeeping.

Run: ``.venv/bin/python benchmarks/cache.py``. Prints a Markdown table. Throughput is in GB/s
(10^9 bytes per second) of item bytes; cache costs are per entry or key. The cache hit vs. miss
time of a whole request goes through the pipeline and is measured there.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import blake3
import numpy as np
import torch
import xxhash
from mmproc.cache import ProcessorCache, compact_entry
from mmproc.hashing import HASH_ALGORITHMS, hash_context, hash_item, item_key
from PIL import Image

Row = tuple[str, str, str]
ARCH = "Qwen2VLForConditionalGeneration"


def best_of(fn: Callable[[], object], repeat: int, number: int = 1) -> float:
    """Return the best mean time (s) of ``number`` calls over ``repeat`` rounds."""
    fn()  # warm up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return min(times)


def timed(what: str, seconds: float, nbytes: int | None = None) -> Row:
    """A row for one whole operation: its throughput (if it has bytes) and time."""
    rate = f"{nbytes / seconds / 1e9:.2f} GB/s" if nbytes else ""
    per = f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} µs"
    return what, rate, per


def per_unit(what: str, seconds: float, n: int, unit: str) -> Row:
    """A row for ``n`` operations, as time per ``unit``."""
    return what, "", f"{seconds / n * 1e6:.2f} µs/{unit}"


def hashing_rows(repeat: int) -> list[Row]:
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    video = rng.integers(0, 256, (16, 768, 1024, 3), dtype=np.uint8)
    big = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    config = {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    options = {"device_normalize": True, "hf_kwargs": {"fps": 2.0}}
    rows = []
    for algorithm in HASH_ALGORITHMS:
        ctx = hash_context(ARCH, config, options, algorithm)
        digest = hash_item("image", image, algorithm)
        rows += [
            timed(
                f"{algorithm}: hash_item, 1024x768 RGB PIL image (2.4 MB)",
                best_of(lambda a=algorithm: hash_item("image", image, a), repeat, 20),
                rgb.nbytes,
            ),
            timed(
                f"{algorithm}: hash_item, 1024x768x3 uint8 array",
                best_of(lambda a=algorithm: hash_item("video", rgb[None], a), repeat, 20),
                rgb.nbytes,
            ),
            timed(
                f"{algorithm}: hash_item, 16-frame 1024x768 video array (37.7 MB)",
                best_of(lambda a=algorithm: hash_item("video", video, a), repeat, 2),
                video.nbytes,
            ),
            timed(
                f"{algorithm}: hash_item, 64 MiB uint8 array",
                best_of(lambda a=algorithm: hash_item("video", big, a), repeat, 2),
                big.nbytes,
            ),
            timed(
                f"{algorithm}: hash_context (Qwen2-VL-sized config)",
                best_of(lambda a=algorithm: hash_context(ARCH, config, options, a), repeat, 200),
            ),
            timed(
                f"{algorithm}: item_key",
                best_of(lambda a=algorithm, c=ctx, d=digest: item_key(c, d, a), repeat, 2000),
            ),
        ]
    return [
        *rows,
        timed(
            "baseline: xxh3_128(image.tobytes())",
            best_of(lambda: xxhash.xxh3_128(image.tobytes()).digest(), repeat, 20),
            rgb.nbytes,
        ),
        timed(
            "baseline: blake3, 64 MiB, one thread",
            best_of(lambda: blake3.blake3(memoryview(big)).digest(), repeat, 2),
            big.nbytes,
        ),
    ]


def cache_rows(repeat: int, n: int = 1000) -> list[Row]:
    # Small owned tensors, shaped like a Qwen2-VL item: this measures bookkeeping, not copies.
    entries = {
        f"{i:032x}": {"pixel_values": torch.zeros(16, 6), "image_grid_thw": torch.tensor([1, 4, 4])}
        for i in range(n)
    }
    keys = list(entries)
    miss_keys = [f"m{k}" for k in keys]
    entry_bytes = 16 * 6 * 4 + 3 * 8

    def put_each(max_bytes: int) -> None:
        cache = ProcessorCache(max_bytes)
        for key, entry in entries.items():
            cache.put(key, entry)

    full = ProcessorCache(1 << 30)
    full.insert(entries)

    # The one real cost of inserting: a per-item view of a multi-image batch is copied compact.
    batch = torch.zeros(2 * 3996, 1176)  # Qwen2-VL patches of two 1024x768 images, float32
    view = {"pixel_values": batch[:3996], "image_grid_thw": torch.tensor([1, 54, 74])}
    view_bytes = view["pixel_values"].nbytes

    return [
        per_unit(
            f"put x{n}, one call per entry",
            best_of(lambda: put_each(1 << 30), repeat),
            n,
            "entry",
        ),
        per_unit(
            f"insert {n} entries in one call, protect={n} keys",
            best_of(lambda: ProcessorCache(1 << 30).insert(entries, protect=keys), repeat),
            n,
            "entry",
        ),
        per_unit(
            f"put x{n} into a {n // 2}-entry cache (evicting)",
            best_of(lambda: put_each(entry_bytes * (n // 2)), repeat),
            n,
            "entry",
        ),
        per_unit(
            f"lookup {n} keys, all hits, one call",
            best_of(lambda: full.lookup(keys), repeat, 5),
            n,
            "key",
        ),
        per_unit(
            f"lookup {n} keys, all misses, one call",
            best_of(lambda: full.lookup(miss_keys), repeat, 5),
            n,
            "key",
        ),
        per_unit(
            f"lookup x{n}, one key per call",
            best_of(lambda: [full.lookup([k]) for k in keys], repeat),
            n,
            "key",
        ),
        timed(
            f"compact copy of a 1024x768 Qwen2-VL item view ({view_bytes / 1e6:.1f} MB)",
            best_of(lambda: compact_entry(view), repeat, 5),
            view_bytes,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmark hashing and the processor cache.")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per measurement (best kept)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # per-request work runs on one worker thread
    rows = hashing_rows(args.repeat) + cache_rows(args.repeat)
    width = max(len(r[0]) for r in rows)
    print(f"| {'what':<{width}} | {'throughput':>11} | {'time':>15} |")
    print(f"|{'-' * (width + 2)}|{'-' * 12}:|{'-' * 16}:|")
    for what, rate, per in rows:
        print(f"| {what:<{width}} | {rate:>11} | {per:>15} |")


if __name__ == "__main__":
    main()
