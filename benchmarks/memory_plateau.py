"""Resident memory over a long run of distinct requests: where it levels off, against the cache.

A server preprocesses an endless stream of new images; its memory must level off at what the
processor-output cache is allowed (``cache_bytes``) plus a fixed overhead, not keep growing. This
script sends ``--requests`` distinct ``--size`` images (``--callers`` threads, or ``--tasks``
concurrent ``process_async`` calls) to a processor with a ``--cache-mib`` cache, and prints the
process's RSS above its level just before the first request, with the cache's own bytes, every
``--every`` requests. The last rows are the plateau. Target: within 256 MB of the cache bound for
2,000 640x480 requests with a 64 MiB cache.

``--explain`` adds where the memory is at the end: glibc's arena totals (``mallinfo2``: in use
and free-but-held), Python objects (``tracemalloc`` is not used: it slows every allocation), and
the thread count.

Run: ``.venv/bin/python benchmarks/memory_plateau.py [--requests 2000] [--cache-mib 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import mmproc
import numpy as np
from mmproc.demo_models import open_model
from PIL import Image

MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_totals() -> dict[str, int] | None:
    """glibc's heap: bytes in use and bytes free but held (None off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return {
        "arenas (sbrk + mmap'd arenas)": info.arena,
        "large blocks (own mmap)": info.hblkhd,
        "in use": info.uordblks,
        "free, held by the arenas": info.fordblks,
    }


def _image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo:qwen2-vl", help="folder or demo:NAME")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--size", default="640x480", help="image WxH")
    parser.add_argument("--cache-mib", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--callers", type=int, default=8, help="threads calling process()")
    parser.add_argument("--tasks", type=int, default=0, help="use process_async with N tasks")
    parser.add_argument("--every", type=int, default=200, help="print a row every N requests")
    parser.add_argument("--backend", default=None, choices=["pil", "torchvision"])
    parser.add_argument("--no-device-normalize", action="store_true", help="float32 pixels")
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="mmproc-rss-") as tmp:
        folder, described = open_model(args.model, Path(tmp))
        options: dict[str, object] = {}
        if args.backend:
            options["backend"] = args.backend
        if args.no_device_normalize:
            options["device_normalize"] = False
        processor = mmproc.get_processor(
            folder, workers=args.workers, warm_up=True, cache_bytes=args.cache_mib * MIB, **options
        )
        prompt = processor.model.get_dummy_text(processor.ctx, {"image": 1})
        processor.process(prompt, {"image": [_image(10**9, width, height)]})
        base = rss_bytes()
        how = f"{args.tasks} async tasks" if args.tasks else f"{args.callers} caller threads"
        print(
            f"{described}\n{args.requests} distinct {args.size} images, cache {args.cache_mib} "
            f"MiB, {processor.workers} workers, {how}, {processor!r}; RSS before the first request "
            f"{base / MIB:.0f} MiB"
        )
        print(f"{'requests':>8} {'RSS above start (MiB)':>22} {'cache (MiB)':>12} {'s':>6}")

        # Each request makes its own image, so the inputs alive at any time are the requests in
        # flight, as in a server, and the RSS is the processor's.
        def one(index: int) -> None:
            processor.process(prompt, {"image": [_image(index, width, height)]})

        async def burst(indices: range) -> None:
            limit = asyncio.Semaphore(args.tasks)

            async def one_async(index: int) -> None:
                async with limit:
                    image = _image(index, width, height)
                    await processor.process_async(prompt, {"image": [image]})

            await asyncio.gather(*(one_async(index) for index in indices))

        start = time.perf_counter()
        pool = concurrent.futures.ThreadPoolExecutor(args.callers)
        for first in range(0, args.requests, args.every):
            indices = range(first, min(first + args.every, args.requests))
            if args.tasks:
                asyncio.run(burst(indices))
            else:
                list(pool.map(one, indices))
            print(
                f"{indices[-1] + 1:8d} {(rss_bytes() - base) / MIB:22.1f} "
                f"{processor.cache.nbytes / MIB:12.1f} {time.perf_counter() - start:6.1f}"
            )
        pool.shutdown()
        if args.explain:
            totals = malloc_totals()
            for name, value in (totals or {}).items():
                print(f"  malloc {name:<32} {value / MIB:8.1f} MiB")
            print(f"  threads {threading.active_count()}")
        processor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
