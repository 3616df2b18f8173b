"""End-to-end request cost through mmproc vs calling the transformers processor directly.

Prints, for a Qwen2-VL folder (the real preprocessor settings) and one image per request:

* per-image CPU time of transformers' processor called directly (float path), of mmproc's float
  path (``device_normalize=False``), and of mmproc's uint8 path (``device_normalize=True``; on the
  PIL backend this is the qwen_vl plugin's native fast path), cache off, for both backends;
* a cache hit against a miss for the same request;
* bytes of pixels per image on the wire;
* requests/s through a Processor with 1 and 2 workers (device normalisation on, so the PIL
  backend takes the qwen_vl plugin's uint8 path).

Times are the best of ``--repeat`` runs of CPU time on the calling thread's process (the work runs
on one pool worker), so the other core's load disturbs them less than wall time. Run:
``.venv/bin/python benchmarks/pipeline.py [--sizes 1024x768 1920x1080] [--repeat 9]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from mmproc.factory import get_processor
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from PIL import Image

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>"


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: clones, allocator, caches of Pillow and torch
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times) * 1e3


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    # Smooth structure (upsampled noise) rather than white noise: resampling behaves as on photos.
    return Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)


def measure(float_path, uint8_path, image: Image.Image, repeat: int) -> tuple[float, ...]:
    """(HF direct ms, mmproc float ms, mmproc uint8 ms, float32 MiB, wire MiB) for one image."""
    hf = float_path.hf_processor
    direct = best_ms(lambda: hf(text=[PROMPT], images=[image], return_tensors="pt"), repeat)
    mm_float = best_ms(lambda: float_path.process(PROMPT, {"image": [image]}), repeat)
    mm_uint8 = best_ms(lambda: uint8_path.process(PROMPT, {"image": [image]}), repeat)
    pixels = uint8_path.process(PROMPT, {"image": [image]}).features[0].data["pixel_values"]
    f32_mib = pixels.numel() * 4 / 2**20
    wire_mib = pixels.numel() * pixels.element_size() / 2**20
    return direct, mm_float, mm_uint8, f32_mib, wire_mib


def throughput(folder: Path, backend: str, workers: int, images: list, rounds: int) -> float:
    """Best requests/s of 32 one-image requests sent from 8 threads through a Processor."""
    from concurrent.futures import ThreadPoolExecutor

    best = 0.0
    with get_processor(folder, backend=backend, workers=workers, cache_bytes=0, warm_up=True) as p:
        for _ in range(rounds):
            with ThreadPoolExecutor(8) as callers:
                start = time.perf_counter()
                list(
                    callers.map(lambda i: p.process(PROMPT, {"image": [images[i % 8]]}), range(32))
                )
                best = max(best, 32 / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["640x480", "1024x768", "1920x1080"])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes]

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_qwen2_vl_folder(Path(tmp) / "qwen2-vl")
        rows = []
        for backend in ("pil", "torchvision"):
            common = {"backend": backend, "workers": 1, "cache_bytes": 0}
            with (
                get_processor(folder, device_normalize=False, **common) as float_path,
                get_processor(folder, **common) as uint8_path,
            ):
                for width, height in sizes:
                    figures = measure(float_path, uint8_path, photo(width, height), args.repeat)
                    rows.append((backend, f"{width}x{height}", *figures))

        print("Per-image CPU ms, one image per request, cache off (best of", args.repeat, "runs)")
        print(
            f"{'backend':<12} {'size':<10} {'HF direct':>9} {'mmproc float':>12} "
            f"{'mmproc uint8':>12} {'direct/uint8':>12} {'float32 MiB':>11} {'wire MiB':>8}"
        )
        for backend, size, direct, mm_float, mm_uint8, f32_mib, wire_mib in rows:
            print(
                f"{backend:<12} {size:<10} {direct:>9.1f} {mm_float:>12.1f} {mm_uint8:>12.1f} "
                f"{direct / mm_uint8:>11.2f}x {f32_mib:>11.2f} {wire_mib:>8.2f}"
            )

        print()
        print("Cache: the same request missing vs hitting (1024x768, PIL backend, uint8)")
        with get_processor(folder, backend="pil", workers=1) as proc:
            misses, hits = [], []
            for i in range(args.repeat):
                proc.cache.clear()
                fresh = photo(1024, 768, seed=100 + i)
                start = time.perf_counter()
                proc.process(PROMPT, {"image": [fresh]})
                misses.append(time.perf_counter() - start)
                start = time.perf_counter()
                proc.process(PROMPT, {"image": [fresh]})
                hits.append(time.perf_counter() - start)
        miss_ms, hit_ms = min(misses) * 1e3, min(hits) * 1e3
        print(f"{'miss ms':>8} {'hit ms':>8} {'speedup':>8}")
        print(f"{miss_ms:>8.2f} {hit_ms:>8.2f} {miss_ms / hit_ms:>7.1f}x")
        print(
            f"(median miss {statistics.median(misses) * 1e3:.2f} ms, "
            f"median hit {statistics.median(hits) * 1e3:.2f} ms, wall time)"
        )

        print()
        print("End to end through Processor: 32 requests (1024x768) from 8 threads, cache off")
        print(f"{'backend':<12} {'1 worker req/s':>14} {'2 workers req/s':>15} {'ratio':>6}")
        images = [photo(1024, 768, seed=200 + i) for i in range(8)]
        for backend in ("pil", "torchvision"):
            one = throughput(folder, backend, 1, images, max(args.repeat // 2, 1))
            two = throughput(folder, backend, 2, images, max(args.repeat // 2, 1))
            print(f"{backend:<12} {one:>14.1f} {two:>15.1f} {two / one:>5.2f}x")


if __name__ == "__main__":
    main()
