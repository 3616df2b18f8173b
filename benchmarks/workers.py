"""Requests/s of a Qwen2-VL processor with 1 and 2 preprocessing workers.

One request = the HF processor on dummy text and one 1024x768 image (PIL input), as the request
pipeline runs it. For each image-processor backend (PIL, torchvision) the script measures:

- ``HF direct``: the processor called in a loop on the caller's thread (the baseline);
- ``HF + thread pool (shared)``: a plain ``ThreadPoolExecutor(2)`` calling one shared processor,
  torch left at its default threads (the "plain transformers" reference: not isolated);
- ``mmproc 1 worker`` / ``mmproc 2 workers``: a ``ProcessorPool`` (clones warmed up first);
- on the torchvision backend, ``mmproc 1 worker, 1 torch thread`` (one worker alone already runs
  torch's intra-op threads on every core, so this is the like-for-like baseline of two workers
  with one thread each) and ``mmproc 2 workers, torch default threads``
  (``intra_op_threads=None``: oversubscribed), to show what the intra-op setting is worth.
- with ``--processes``, ``HF in 1 process`` / ``HF in 2 processes``: the same requests split over
  separate processes with one torch thread each. Nothing is shared (no GIL, no allocator), so
  their ratio is the most any thread pool could reach on this machine. (Their ``others`` column
  counts those processes themselves.)

Requests are submitted all at once and the clock stops when the last one is done. Configurations
are interleaved round-robin over the repeats, so that a burst of load from other processes hits
every configuration alike; the table shows the median and the best of the repeats, and each
ratio is the median of its per-round ratios (judged against the target) next to best / best.
The ``others`` column is the share of the cores other processes used during the
measurements (from ``/proc/stat``, minus this process's CPU time); ``--wait-quiet S`` waits up to
S seconds before each measurement for them to go quiet, and ``--retries N`` retakes a measurement
disturbed by more than ``--max-others`` (keeping the least disturbed one).

Targets: 2 workers >= 1.85x one worker on the PIL path and >= 1.7x on the torchvision path (there
against one worker with one torch thread, like each of the two), and mmproc's one worker within
5 % of calling HF directly.

``--device cuda`` runs the torchvision backend on the GPU (``device="cuda"`` given to the fast
image processor) with 1 and 2 workers; ``--clone-cost`` measures what a clone of a processor with
a Qwen2-sized tokenizer (151k-token BPE) costs, with and without sharing the tokenizer.

``--kinds`` measures whole requests (``Processor.process``, the cache off, a new 1024x768 image
each) with thread workers against process workers (``worker_kind="process"``) at the counts of
``--kind-workers`` (default 1 2), on the qwen_vl plugin's demo folder, twice as many callers as
workers, the two kinds open side by side and measured in alternating rounds (the ratio is the
median of the rounds' ratios); with the process workers' start-up seconds and resident memory
each. Its rounds are 256 requests unless ``--requests`` says otherwise: rounds of a few tenths of
a second gave ratios 0.15x apart from run to run. The target on this machine: process workers
at 2 >= 0.9x thread workers at 2.

Run: ``.venv/bin/python benchmarks/workers.py [--requests 32] [--repeats 5] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmproc.executor import ProcessorPool, intra_op_threads_for
from mmproc.worker_count import fast_processor_kwargs

ROOT = Path(__file__).resolve().parent.parent


# The tests' local Qwen2-VL processor builder (no hub access), as the tests import it.
sys.path.insert(0, str(ROOT / "tests"))
import _qwen_processor as qwen  # noqa: E402

# A measurement: returns the seconds taken by `n` requests.
Measure = Callable[[int], float]


def _request(
    images: list[Any], kwargs: dict[str, Any], sync: Callable[[], None]
) -> Callable[..., None]:
    text = qwen.dummy_text(1)

    def one(i: int, *, processor: Any) -> None:
        processor(text=text, images=[images[i % len(images)]], return_tensors="pt", **kwargs)
        sync()
        # The output (~19 MB of float32 patches) is dropped here in every configuration: a
        # harness that kept all the pooled results alive until the end would make the pooled
        # rows fault in fresh memory for every request while the direct loop reuses its own.

    return one


def _direct(processor: Any, one: Callable[..., Any]) -> Measure:
    def measure(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            one(i, processor=processor)
        return time.perf_counter() - start

    return measure


def _direct_on_a_thread(processor: Any, one: Callable[..., Any]) -> Measure:
    """The direct loop, run on one plain thread instead of the main thread.

    Shows the cost of the pool itself: the main thread allocates from glibc's main arena, which
    gives freed memory back and faults it in again (measured here: ~950 page faults a request on
    the main thread against ~300 on a worker thread, PIL backend), so a worker thread can beat
    the main thread at the very same work.
    """
    loop = _direct(processor, one)

    def measure(n: int) -> float:
        took: list[float] = []
        thread = threading.Thread(target=lambda: took.append(loop(n)))
        thread.start()
        thread.join()
        return took[0]

    return measure


def _shared_thread_pool(processor: Any, one: Callable[..., Any], workers: int) -> Measure:
    pool = concurrent.futures.ThreadPoolExecutor(workers)

    def measure(n: int) -> float:
        start = time.perf_counter()
        for f in [pool.submit(one, i, processor=processor) for i in range(n)]:
            f.result()
        return time.perf_counter() - start

    measure.close = pool.shutdown  # type: ignore[attr-defined]
    return measure


def _mmproc(processor: Any, one: Callable[..., Any], workers: int, **options: Any) -> Measure:
    pool = ProcessorPool(lambda: processor, workers, **options)
    pool.warm_up()

    def measure(n: int) -> float:
        start = time.perf_counter()
        for f in [pool.submit(one, i) for i in range(n)]:
            f.result()
        return time.perf_counter() - start

    measure.close = pool.shutdown  # type: ignore[attr-defined]
    return measure


def _process_main(backend: str, connection: Any) -> None:
    """A reference process: its own processor, one torch thread; runs the requests it is sent."""
    import torch

    torch.set_num_threads(1)
    processor = qwen.make_qwen2_vl_processor(backend)
    images = [qwen.make_image(1024, 768, seed=s) for s in range(4)]
    one = _request(images, {}, lambda: None)
    connection.send("ready")
    while (task := connection.recv()) is not None:
        first, count = task
        start = time.perf_counter()
        for i in range(first, first + count):
            one(i, processor=processor)
        connection.send(time.perf_counter() - start)


def _processes(backend: str, count: int) -> Measure:
    """The same requests split over ``count`` processes (one torch thread each): nothing shared,
    no GIL, no allocator; the ceiling a thread pool could reach on this machine."""
    context = multiprocessing.get_context("spawn")
    links = []
    for _ in range(count):
        mine, theirs = context.Pipe()
        process = context.Process(target=_process_main, args=(backend, theirs), daemon=True)
        process.start()
        links.append((process, mine))
    for _, connection in links:
        connection.recv()  # built and ready

    def measure(n: int) -> float:
        share = -(-n // count)
        start = time.perf_counter()
        for index, (_, connection) in enumerate(links):
            connection.send((index * share, share))
        for _, connection in links:
            connection.recv()
        return (time.perf_counter() - start) * n / (share * count)

    def close() -> None:
        for process, connection in links:
            connection.send(None)
            process.join(10)

    measure.close = close  # type: ignore[attr-defined]
    return measure


def _cpu_sample() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, this process's CPU seconds, wall seconds)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # everything but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter()


def _foreign_load(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Share of the cores (0..1) that other processes used between two samples."""
    busy, own, wall = (b - a for a, b in zip(start, end))
    return max(0.0, busy - own) / max(wall, 1e-9) / len(os.sched_getaffinity(0))


def _wait_until_quiet(max_wait_s: float, threshold: float = 0.1) -> None:
    """Wait (at most ``max_wait_s``) for a 0.25 s window where others use < ``threshold``."""
    deadline = time.perf_counter() + max_wait_s
    while time.perf_counter() < deadline:
        start = _cpu_sample()
        time.sleep(0.25)
        if _foreign_load(start, _cpu_sample()) < threshold:
            return


def _run_round_robin(
    configs: dict[str, Callable[[], Measure]],
    requests: int,
    repeats: int,
    wait_quiet_s: float,
    max_others: float,
    retries: int,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """req/s and foreign load of every config, ``repeats`` times, interleaved.

    A measurement during which other processes used more than ``max_others`` of the cores is
    taken again (``retries`` times at most) and the least disturbed one is kept. A pool changes
    torch's process-wide intra-op threads while it lives, so each is built, warmed up, measured
    and shut down within its turn of the round.
    """
    rates: dict[str, list[float]] = {name: [] for name in configs}
    loads: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, build in configs.items():
            measure = build()
            try:
                measure(max(2, requests // 8))  # warm caches, spawn threads
                taken: list[tuple[float, float]] = []  # (foreign load, req/s)
                for _attempt in range(retries + 1):
                    if wait_quiet_s:
                        _wait_until_quiet(wait_quiet_s, max_others)
                    start = _cpu_sample()
                    rate = requests / measure(requests)
                    taken.append((_foreign_load(start, _cpu_sample()), rate))
                    if taken[-1][0] <= max_others:
                        break
                load, rate = min(taken)
                rates[name].append(rate)
                loads[name].append(load)
            finally:
                close = getattr(measure, "close", None)
                if close is not None:
                    close()
    return rates, loads


def bench_backend(
    backend: str,
    device: str,
    requests: int,
    repeats: int,
    with_references: bool,
    with_processes: bool = False,
    wait_quiet_s: float = 0.0,
    max_others: float = 1.0,
    retries: int = 0,
) -> tuple[list[tuple[str, float, float, float]], dict[str, list[float]]]:
    """Rows ``(config, median req/s, best req/s, median foreign load)`` for one backend, and
    every config's req/s round by round (for paired ratios)."""
    import torch

    processor = qwen.make_qwen2_vl_processor(backend)
    images = [qwen.make_image(1024, 768, seed=s) for s in range(4)]
    kwargs = fast_processor_kwargs(processor, device) if device != "cpu" else {}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    one = _request(images, kwargs, sync)

    configs: dict[str, Callable[[], Measure]] = {}
    if with_references:
        configs["HF direct"] = lambda: _direct(processor, one)
        configs["HF direct, on one plain thread"] = lambda: _direct_on_a_thread(processor, one)
        configs["HF + thread pool (shared), 2"] = lambda: _shared_thread_pool(processor, one, 2)
    if with_processes and device == "cpu":
        configs["HF in 1 process, 1 torch thread"] = lambda: _processes(backend, 1)
        configs["HF in 2 processes, 1 torch thread each"] = lambda: _processes(backend, 2)
    configs["mmproc 1 worker"] = lambda: _mmproc(processor, one, 1)
    configs["mmproc 2 workers"] = lambda: _mmproc(processor, one, 2)
    if backend == "torchvision":
        # One worker already runs torch's intra-op threads on every core; these rows separate
        # what the second worker adds from what replacing intra-op parallelism adds.
        configs["mmproc 1 worker, 1 torch thread"] = lambda: _mmproc(
            processor, one, 1, intra_op_threads=1
        )
        if with_references:
            configs["mmproc 2 workers, torch default threads"] = lambda: _mmproc(
                processor, one, 2, intra_op_threads=None
            )
    rates, loads = _run_round_robin(configs, requests, repeats, wait_quiet_s, max_others, retries)
    rows = [
        (name, statistics.median(values), max(values), statistics.median(loads[name]))
        for name, values in rates.items()
    ]
    return rows, rates


def bench_hop(calls: int = 2000) -> tuple[float, float]:
    """Microseconds per call: a no-op called directly, and through a one-worker pool's ``run``."""
    with ProcessorPool(lambda: object(), 1) as pool:
        pool.warm_up()

        def noop(*, processor: Any) -> None:
            return None

        start = time.perf_counter()
        for _ in range(calls):
            noop(processor=None)
        direct = (time.perf_counter() - start) / calls * 1e6
        start = time.perf_counter()
        for _ in range(calls):
            pool.run(noop)
        pooled = (time.perf_counter() - start) / calls * 1e6
    return direct, pooled


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_clone_cost(repeats: int = 3) -> list[tuple[str, float]]:
    """Milliseconds (best of ``repeats``) to deep-copy parts of a Qwen2-sized processor."""
    processor = qwen.make_qwen2_vl_processor("pil", qwen2_sized=True)
    cases: dict[str, Callable[[], Any]] = {
        "whole processor (deep copy)": lambda: copy.deepcopy(processor),
        "tokenizer alone": lambda: copy.deepcopy(processor.tokenizer),
        "image processor alone": lambda: copy.deepcopy(processor.image_processor),
        "video processor alone": lambda: copy.deepcopy(processor.video_processor),
        "processor, tokenizer shared": lambda: copy.deepcopy(
            processor, {id(processor.tokenizer): processor.tokenizer}
        ),
    }
    rows = []
    for name, clone in cases.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            clone()
            times.append((time.perf_counter() - start) * 1e3)
        rows.append((name, min(times)))
    before = _rss_mib()
    keep = [copy.deepcopy(processor) for _ in range(3)]
    rows.append(("RSS per full clone (MiB, approx.)", (_rss_mib() - before) / len(keep)))
    return rows


def _print_table(title: str, rows: list[tuple[str, float, float, float]]) -> None:
    print(f"\n{title}")
    print(f"  {'configuration (req/s)':<44} {'median':>8} {'best':>8} {'others':>7}")
    for name, median, best, load in rows:
        print(f"  {name:<44} {median:>8.2f} {best:>8.2f} {load:>6.0%}")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench_kinds(backend: str, counts: list[int], requests: int, repeats: int) -> None:
    """Thread workers against process workers on whole requests; prints a table.

    At each worker count both processors are open at once and measured in alternating rounds
    (thread first, then process first), so that a burst of load elsewhere hits both alike; the
    ratio is the median of the rounds' ratios."""
    import tempfile

    import mmproc
    import numpy as np
    from mmproc_qwen_vl.demo import write_qwen2_vl_folder
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8))
        for _ in range(requests)
    ]
    prompt = "<|vision_start|><|image_pad|><|vision_end|>"

    def serve(proc: Any, image: Any) -> None:
        # A server ships a request's outputs and drops them; holding every output of a round
        # would measure a caller that keeps hundreds of megabytes of tensors alive.
        proc.process(prompt, {"image": [image]})

    def rate(proc: Any, workers: int) -> float:
        with concurrent.futures.ThreadPoolExecutor(2 * workers) as callers:
            begin = time.perf_counter()
            list(callers.map(lambda image: serve(proc, image), images))
            return requests / (time.perf_counter() - begin)

    rows = []
    ratios: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_qwen2_vl_folder(Path(tmp) / "qwen2-vl")
        for workers in counts:
            procs, ready = {}, {}
            for kind in ("thread", "process"):
                start = time.perf_counter()
                procs[kind] = mmproc.get_processor(
                    folder,
                    workers=workers,
                    worker_kind=kind,
                    backend=backend,
                    cache_bytes=0,
                    warm_up=True,
                )
                ready[kind] = time.perf_counter() - start
            try:
                for proc in procs.values():
                    rate(proc, workers)  # warm: every worker has run a request
                rates: dict[str, list[float]] = {"thread": [], "process": []}
                for round_ in range(repeats):
                    order = ("thread", "process") if round_ % 2 == 0 else ("process", "thread")
                    for kind in order:
                        rates[kind].append(rate(procs[kind], workers))
                ratios[workers] = statistics.median(
                    p / t for p, t in zip(rates["process"], rates["thread"])
                )
                for kind, proc in procs.items():
                    extra = ""
                    if proc._processes is not None:
                        rss = [_rss_mb(pid) for pid in proc._processes.pids]
                        starts = proc._processes.startup_seconds
                        extra = (
                            f"start {statistics.median(starts):.1f} s, "
                            f"{statistics.median(rss):,.0f} MB each"
                        )
                    median, best = statistics.median(rates[kind]), max(rates[kind])
                    rows.append((kind, workers, median, best, ready[kind], extra))
            finally:
                for proc in procs.values():
                    proc.close()
    print(f"\nwhole requests, {backend} backend, cache off, {requests} requests x {repeats}:")
    print(f"  {'kind':<8} {'workers':>7} {'req/s':>8} {'best':>8} {'ready s':>8}  worker processes")
    for kind, workers, median, best, ready_s, extra in rows:
        print(f"  {kind:<8} {workers:>7} {median:>8.2f} {best:>8.2f} {ready_s:>8.1f}  {extra}")
    for workers in counts:
        judged = (
            ""
            if workers != 2
            else (
                "  (target >= 0.9x: met)"
                if ratios[workers] >= 0.9
                else "  (target >= 0.9x: missed)"
            )
        )
        print(f"  process / thread at {workers}: {ratios[workers]:.2f}x, median of rounds{judged}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints the tables and the ratios against their targets."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, help="requests per measurement (default 32; 256 with --kinds)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="measurements per configuration")
    parser.add_argument("--backends", nargs="+", default=["pil", "torchvision"])
    parser.add_argument(
        "--device", default="cpu", help="also run the torchvision backend on this device (cuda)"
    )
    parser.add_argument("--clone-cost", action="store_true", help="measure what clones cost")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each measurement wait up to S seconds for other processes to go quiet",
    )
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.1,
        metavar="F",
        help="retake a measurement during which other processes used more than F of the cores",
    )
    parser.add_argument(
        "--retries", type=int, default=0, help="how often a disturbed measurement is retaken"
    )
    parser.add_argument("--no-references", action="store_true", help="only the mmproc rows")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="add the requests split over 1 and 2 processes: the no-GIL ceiling of this machine",
    )
    parser.add_argument(
        "--kinds", action="store_true", help="whole requests: thread against process workers"
    )
    parser.add_argument("--kind-workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    if args.kinds:
        for backend in args.backends:
            bench_kinds(backend, args.kind_workers, args.requests or 256, args.repeats)
        return 0
    if args.requests is None:
        args.requests = 32

    import torch

    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error(f"device {args.device!r} is not available here")

    cores = len(os.sched_getaffinity(0))
    print(
        f"cores: {cores}, torch threads: {torch.get_num_threads()}, "
        f"intra-op threads with 2 workers: {intra_op_threads_for(2)}, "
        f"load average at start: {os.getloadavg()[0]:.2f}"
    )
    print(f"{args.requests} requests x {args.repeats} repeats, 1024x768: median and best")

    # (what, numerator, denominator, target or 0): computed on medians and on bests.
    ratio_specs: list[tuple[str, str, str, float]] = []
    tables: dict[str, dict[str, list[float]]] = {}
    for backend in args.backends:
        rows, tables[backend] = bench_backend(
            backend,
            "cpu",
            args.requests,
            args.repeats,
            with_references=not args.no_references,
            with_processes=args.processes,
            wait_quiet_s=args.wait_quiet,
            max_others=args.max_others,
            retries=args.retries,
        )
        _print_table(f"{backend} backend, cpu", rows)
        if backend == "pil":
            ratio_specs.append(
                ("pil: 2 workers / 1 worker", "mmproc 2 workers", "mmproc 1 worker", 1.85)
            )
        else:
            ratio_specs += [
                (
                    f"{backend}: 2 workers / 1 worker, 1 torch thread each",
                    "mmproc 2 workers",
                    "mmproc 1 worker, 1 torch thread",
                    1.7,
                ),
                (
                    f"{backend}: 2 workers / 1 worker on all cores",
                    "mmproc 2 workers",
                    "mmproc 1 worker",
                    0.0,
                ),
            ]
        if not args.no_references:
            ratio_specs.append(
                (f"{backend}: 2 workers / HF direct", "mmproc 2 workers", "HF direct", 0.0)
            )
        if args.processes:
            ratio_specs.append(
                (
                    f"{backend}: 2 processes / 1 process (no GIL)",
                    "HF in 2 processes, 1 torch thread each",
                    "HF in 1 process, 1 torch thread",
                    0.0,
                )
            )
        if not args.no_references:
            ratio_specs += [
                (f"{backend}: 1 worker / HF direct", "mmproc 1 worker", "HF direct", 0.95),
                (
                    f"{backend}: 1 worker / HF direct on a thread",
                    "mmproc 1 worker",
                    "HF direct, on one plain thread",
                    0.95,
                ),
                (
                    f"{backend}: HF thread pool (shared) / direct",
                    "HF + thread pool (shared), 2",
                    "HF direct",
                    0.0,
                ),
            ]
        if backend == "torchvision" and not args.no_references:
            ratio_specs.append(
                (
                    "torchvision: 2 workers, default torch threads / 1",
                    "mmproc 2 workers, torch default threads",
                    "mmproc 1 worker",
                    0.0,
                )
            )
    if args.device != "cpu":
        key = f"torchvision@{args.device}"
        rows, tables[key] = bench_backend(
            "torchvision",
            args.device,
            args.requests,
            args.repeats,
            with_references=True,
            wait_quiet_s=args.wait_quiet,
            max_others=args.max_others,
            retries=args.retries,
        )
        _print_table(f"torchvision backend, {args.device}", rows)
        ratio_specs += [
            (f"{key}: 2 workers / 1 worker", "mmproc 2 workers", "mmproc 1 worker", 0.0),
            (f"{key}: 1 worker / HF direct", "mmproc 1 worker", "HF direct", 0.95),
        ]

    # Paired: each round measures every configuration back to back, so the ratio within a round
    # cancels slow drifts of the machine; the median over rounds is judged against the target.
    print("\nratios (median of per-round ratios | best / best)")
    for what, top, bottom, target in ratio_specs:
        rates = tables[what.split(":")[0]]
        paired = statistics.median(a / b for a, b in zip(rates[top], rates[bottom]))
        by_best = max(rates[top]) / max(rates[bottom])
        shown = f"target >= {target:.2f}: " if target else ""
        verdict = "" if not target else ("ok" if paired >= target else "BELOW")
        print(f"  {what:<56} {paired:>5.2f}x | {by_best:>5.2f}x  {shown}{verdict}")

    direct_us, pooled_us = bench_hop()
    print(
        f"\nthread hop: no-op direct {direct_us:.2f} us, via ProcessorPool.run {pooled_us:.1f} us"
    )

    if args.clone_cost:
        print("\nclone cost, Qwen2-sized tokenizer (151,643-token BPE), best of 3")
        for name, value in bench_clone_cost():
            print(f"  {name:<42} {value:>9.2f}")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
