"""How long a serving front end's event loop is held up while mmproc preprocesses on it.

A front end runs HTTP, streaming and its engine client on one asyncio loop and awaits
``Processor.process_async`` there. This script starts ``--tasks`` concurrent ``process_async``
calls (distinct images, so each one runs the HF processor) on a processor with ``--workers``
workers, and meanwhile runs a heartbeat on the same loop: ``await asyncio.sleep(0.001)`` in a loop,
recording how much later than 1 ms each wake-up came. The lag is the time the loop thread could
not run: work done on the loop itself, or the loop thread waiting for the GIL while the worker,
prepare and IO threads hold it.

It prints the heartbeat's p50 / p99 / max lag and the requests' throughput, for the processor as
configured and for an idle loop (the floor of this machine). Target: p99 under 10 ms with 64 tasks
and 2 workers.

Nothing heavy runs on the loop (requests are prepared on the prepare pool, processed on the worker
pool; ``tests/test_processor.py`` checks that), so what is left is the loop thread waiting for a
core and for the GIL while the workers and their torch threads use both cores.
``--switch-interval-ms`` shows what a shorter GIL switch interval buys (it is process-wide, so
mmproc leaves it to the application) and ``--gc-freeze`` what taking start-up objects out of the
cyclic collector buys.

Run: ``.venv/bin/python benchmarks/event_loop_lag.py [--tasks 64] [--workers 2] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
from mmproc.demo_models import open_model
from PIL import Image

HEARTBEAT_S = 0.001


async def _heartbeat(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(HEARTBEAT_S)
        lags.append(time.perf_counter() - start - HEARTBEAT_S)


async def _round(processor: Any, prompt: str, images: list[Any]) -> tuple[list[float], float]:
    lags: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(lags, stop))
    await asyncio.sleep(0.05)  # the heartbeat's own start-up is not the processor's lag
    lags.clear()
    start = time.perf_counter()
    await asyncio.gather(*(processor.process_async(prompt, {"image": [im]}) for im in images))
    elapsed = time.perf_counter() - start
    stop.set()
    await beat
    return lags, elapsed


async def _idle(seconds: float) -> list[float]:
    lags: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(lags, stop))
    await asyncio.sleep(seconds)
    stop.set()
    await beat
    return lags


def _row(name: str, lags: list[float], requests: int, elapsed: float | None) -> str:
    ms = sorted(lag * 1e3 for lag in lags)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    rate = f"{requests / elapsed:8.1f}" if elapsed else f"{'-':>8}"
    return f"{name:<34} {statistics.median(ms):7.2f} {p99:7.2f} {ms[-1]:7.2f} {len(ms):7d} {rate}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo:qwen2-vl", help="folder or demo:NAME")
    parser.add_argument("--tasks", type=int, default=64, help="concurrent process_async calls")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", default="640x480", help="image WxH")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --tasks requests")
    parser.add_argument("--backend", default="pil", choices=["pil", "torchvision"])
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="set sys.setswitchinterval first (default: leave CPython's 5 ms)",
    )
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once the processor is built (start-up objects leave the collector)",
    )
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    width, height = (int(v) for v in args.size.split("x"))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="mmproc-lag-") as tmp:
        folder, described = open_model(args.model, Path(tmp))
        with mmproc.get_processor(
            folder, workers=args.workers, warm_up=True, cache_bytes=0, backend=args.backend
        ) as processor:
            prompt = processor.model.get_dummy_text(processor.ctx, {"image": 1})
            if args.gc_freeze:
                gc.collect()
                gc.freeze()

            async def run() -> None:
                print(
                    f"{described}; {args.tasks} tasks x {args.rounds} rounds, {args.size} "
                    f"images, {processor.workers} workers, backend {args.backend}, "
                    f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms"
                )
                print(
                    f"{'heartbeat lag (ms)':<34} {'p50':>7} {'p99':>7} {'max':>7} "
                    f"{'beats':>7} {'req/s':>8}"
                )
                idle = await _idle(1.0)
                print(_row("idle loop", idle, 0, None))
                images = [
                    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                    for _ in range(args.tasks)
                ]
                await processor.process_async(prompt, {"image": [images[0]]})  # first-call costs
                all_lags: list[float] = []
                total = 0.0
                for index in range(args.rounds):
                    fresh = [
                        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                        for _ in range(args.tasks)
                    ]
                    lags, elapsed = await _round(processor, prompt, fresh)
                    print(_row(f"round {index + 1}", lags, args.tasks, elapsed))
                    all_lags += lags
                    total += elapsed
                print(_row("all rounds", all_lags, args.tasks * args.rounds, total))

            asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
