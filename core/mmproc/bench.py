"""``mmproc bench``: how fast preprocessing runs for a model on this machine.

For a model (``--model FOLDER`` or a plugin's demo model, ``--model demo:NAME``; ``--list``
shows them) and synthetic media of a chosen size (decoded, or with ``--encoded`` as the files
a server receives, which a cache hit then never decodes), it measures, for each worker count
asked for:

* **latency**: one request at a time (cache off), median and 95th percentile;
* **throughput**: ``--requests`` requests sent by ``--callers`` threads at once (cache off), and
  its ratio to the first worker count;

and once: a cache hit against a miss, and what one request costs on the wire (bytes, frames, and
``encode_request`` / ``decode_request`` times). With ``--stages``, one worker's misses and hits
broken down by pipeline stage (:data:`mmproc.stages.STAGES`: parsing, hashing, lookups, thread
hops, the HF call, splitting, prompt updates, cache insertion, tokenising, expanding) next to the
bare HF call on the same items, with mmproc's cost over it: measured ``--samples`` times
(default 5), the verdict against the target taken from the median of those samples. The prompt
is the model's own dummy text for one item (``get_dummy_text``), so any plugin's model can be
measured without writing a prompt.

It prints a table, or JSON with ``--json``. Figures depend on the machine and on what else runs
on it; they are for choosing ``workers`` and spotting regressions, not for assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mmproc.demo_models import add_model_arguments, describe_demo_models, open_model

__all__ = ["add_arguments", "parse_option", "run_bench"]

_DISTINCT_ITEMS = 8  # the requests cycle over this many items (the cache is off anyway)
# Options the benchmark decides itself, and why (or how to steer them instead).
_MANAGED_OPTIONS = {
    "workers": "give the counts to measure with --workers",
    "cache_bytes": "off for the latency and throughput rows, the default for the cache row",
    "warm_up": "clones are made before anything is timed",
}


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be WIDTHxHEIGHT, got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return width, height


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_option(text: str) -> tuple[str, Any]:
    """``--option KEY=VALUE`` (of ``mmproc bench`` and ``mmproc which --check``): the value as
    JSON when it parses (``4``, ``false``, ``{"a": 1}``), else the plain string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"option must be KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``mmproc bench`` options."""
    add_model_arguments(parser)
    parser.add_argument("--modality", choices=("image", "video", "audio"), default="image")
    parser.add_argument(
        "--size", type=_size, default=(1024, 768), help="image / frame size (default 1024x768)"
    )
    parser.add_argument("--frames", type=_positive, default=8, help="frames per video")
    parser.add_argument("--seconds", type=_positive, default=10, help="seconds of audio (16 kHz)")
    parser.add_argument(
        "--encoded",
        action="store_true",
        help="send each item as a file's bytes, as a server receives them: PNG images, H.264 "
        "mp4 video at 2 fps, float WAV audio (decoding is then part of a miss)",
    )
    parser.add_argument("--requests", type=_positive, default=32, help="requests per measurement")
    parser.add_argument("--callers", type=_positive, default=8, help="threads sending requests")
    parser.add_argument(
        "--workers", type=_positive, nargs="+", default=[1, 2], help="worker counts to measure"
    )
    parser.add_argument("--backend", choices=("pil", "torchvision"), default=None)
    parser.add_argument(
        "--worker-kind",
        choices=("thread", "process"),
        default=None,
        help="the workers: threads (the default) or processes (worker_kind)",
    )
    parser.add_argument(
        "--no-device-normalize", action="store_true", help="normalise on the CPU (float32 out)"
    )
    parser.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other get_processor option, e.g. hash_algorithm=xxh3 (repeatable)",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="also break one worker's requests down by pipeline stage, next to the bare HF call",
    )
    parser.add_argument(
        "--samples",
        type=_positive,
        default=5,
        help="with --stages: passes measured; the overhead verdict is their median (default 5)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def _items(args: argparse.Namespace) -> list[Any]:
    from mmproc.demo import demo_audio, demo_file, demo_image, demo_video

    seeds = range(_DISTINCT_ITEMS)
    if args.modality == "image":
        items = [demo_image(seed, args.size) for seed in seeds]
    elif args.modality == "video":
        items = [demo_video(seed, args.size, args.frames) for seed in seeds]
    else:
        items = [demo_audio(seed, args.seconds) for seed in seeds]
    if args.encoded:
        return [demo_file(args.modality, item) for item in items]
    return items


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _median_us(fn: Callable[[], object], calls: int = 200) -> float:
    fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def _measure_workers(folder: Path, options: dict[str, Any], workers: int, args, items) -> dict:
    from mmproc.factory import get_processor

    with get_processor(folder, workers=workers, cache_bytes=0, warm_up=True, **options) as proc:
        prompt = proc.model.get_dummy_text(proc.ctx, {args.modality: 1})

        def one(index: int) -> Any:
            return proc.process(prompt, {args.modality: [items[index % len(items)]]})

        one(0)  # first-call costs
        latencies = []
        for index in range(args.requests):
            start = time.perf_counter()
            one(index)
            latencies.append((time.perf_counter() - start) * 1e3)
        with ThreadPoolExecutor(args.callers) as callers:
            start = time.perf_counter()
            list(callers.map(one, range(args.requests)))
            seconds = time.perf_counter() - start
        return {
            "workers": proc.workers,
            "path": str(proc.path),
            "device_normalize": proc.norm_spec is not None,
            "latency_p50_ms": statistics.median(latencies),
            "latency_p95_ms": _percentile(latencies, 0.95),
            "throughput_rps": args.requests / seconds,
        }


def _measure_cache_and_wire(folder: Path, options: dict[str, Any], args, items) -> dict:
    from mmproc.factory import get_processor
    from mmproc.wire import decode_request, encode_request

    with get_processor(folder, workers=1, warm_up=True, **options) as proc:
        prompt = proc.model.get_dummy_text(proc.ctx, {args.modality: 1})
        misses: list[float] = []
        hits: list[float] = []
        id_hits: list[float] = []
        for index in range(len(items)):
            # A miss, then hits by content hash, then hits by a caller-given id (its first
            # request is a miss under the id's key, not timed).
            ids = {args.modality: [f"bench-item-{index}"]}
            for times, uuids in ((misses, None), (hits, None), (hits, None), (None, ids)):
                start = time.perf_counter()
                out = proc.process(prompt, {args.modality: [items[index]]}, mm_uuids=uuids)
                if times is not None:
                    times.append((time.perf_counter() - start) * 1e3)
            for _ in range(2):
                start = time.perf_counter()
                proc.process(prompt, {args.modality: [items[index]]}, mm_uuids=ids)
                id_hits.append((time.perf_counter() - start) * 1e3)
    request = out.to_engine_request("bench")
    frames = encode_request(request)
    return {
        "cache_miss_p50_ms": statistics.median(misses),
        "cache_hit_p50_ms": statistics.median(hits),
        "cache_id_hit_p50_ms": statistics.median(id_hits),
        "wire_bytes": sum(memoryview(frame).nbytes for frame in frames),
        "wire_frames": len(frames),
        "encode_request_us": _median_us(lambda: encode_request(request)),
        "decode_request_us": _median_us(lambda: decode_request(frames)),
    }


def _measure_stages(folder: Path, options: dict[str, Any], args, items) -> dict:
    """Per-stage medians of misses and hits on one worker, and the bare HF call on the same
    items: the plugin's ``process_mm_data`` on the caller's thread, as the pipeline calls it."""
    from mmproc.context import ProcessingMode
    from mmproc.factory import get_processor
    from mmproc.inputs import parse_mm_data
    from mmproc.stages import STAGES

    with get_processor(folder, workers=1, warm_up=True, **options) as proc:
        prompt = proc.model.get_dummy_text(proc.ctx, {args.modality: 1})
        kwargs = proc.hf_call_kwargs()
        mode = ProcessingMode(
            media_only=True,
            raw_pixels=proc.normalization.raw_pixels_for({}),
            device=proc.device,
            user_kwargs={},
        )
        loaded = [parse_mm_data({args.modality: [item]}, media=proc.media) for item in items]
        proc.process(prompt, {args.modality: [items[0]]})  # first-call costs
        misses, hits, bare = [], [], []
        overheads = []  # one per sample: its median miss less its median bare call, in ms
        rounds = max(1, -(-args.requests // len(items)))
        for _ in range(args.samples):
            sample_misses, sample_bare = [], []
            for _ in range(rounds):
                proc.cache.clear()
                with proc.recording_stages() as log:
                    for item in items:
                        proc.process(prompt, {args.modality: [item]})
                sample_misses += log.clocks
                with proc.recording_stages() as log:
                    for item in items:
                        proc.process(prompt, {args.modality: [item]})
                hits += log.clocks
                # The bare calls keep their outputs for the round, as the cache keeps the
                # misses': memory touched for the first time costs page faults, on either side.
                kept = []
                for mm_items in loaded:
                    start = time.perf_counter()
                    kept.append(
                        proc.model.process_mm_data(
                            proc.ctx, mode, prompt, mm_items, proc.hf_processor, kwargs
                        )
                    )
                    sample_bare.append(time.perf_counter() - start)
                del kept
            overheads.append(
                (statistics.median(c.total for c in sample_misses) - statistics.median(sample_bare))
                * 1e3
            )
            misses += sample_misses
            bare += sample_bare

    def medians(clocks: list[Any]) -> dict[str, float]:
        per_stage = {
            stage: statistics.median(c.seconds.get(stage, 0.0) for c in clocks) * 1e3
            for stage in STAGES
        }
        return {**per_stage, "total": statistics.median(c.total for c in clocks) * 1e3}

    miss = medians(misses)
    bare_ms = statistics.median(bare) * 1e3
    target = max(5.0, 0.1 * bare_ms)
    # One sample's overhead swings with whatever else the machine runs; the verdict is the
    # median of several, each a whole pass over the items.
    overhead = statistics.median(overheads)
    return {
        "requests": len(misses),
        "miss_ms": miss,
        "hit_ms": medians(hits),
        "bare_hf_call_ms": bare_ms,
        "overhead_ms": overhead,
        "overhead_samples_ms": overheads,
        "overhead_target_ms": target,
        "overhead_target_met": overhead <= target,
    }


def _print_stages(stages: dict[str, Any]) -> None:
    from mmproc.stages import STAGES

    miss, hit = stages["miss_ms"], stages["hit_ms"]
    print(
        f"\nstages (one worker, median ms of {stages['requests']} requests; a miss with the "
        "cache on, then the same item as a hit)"
    )
    print(f"{'stage':<15} {'miss':>8} {'hit':>8}  what")
    for stage, what in STAGES.items():
        print(f"{stage:<15} {miss[stage]:>8.3f} {hit[stage]:>8.3f}  {what}")
    print(f"{'total':<15} {miss['total']:>8.3f} {hit['total']:>8.3f}")
    verdict = "met" if stages["overhead_target_met"] else "MISSED"
    samples = stages["overhead_samples_ms"]
    print(
        f"bare HF call (process_mm_data on the caller's thread, outputs kept like the "
        f"cache's): {stages['bare_hf_call_ms']:.3f} "
        f"ms; a miss costs {stages['overhead_ms']:+.3f} ms over it, the median of "
        f"{len(samples)} samples ({min(samples):+.3f} to {max(samples):+.3f}) (target <= "
        f"{stages['overhead_target_ms']:.1f} ms: {verdict})"
    )


def _print_report(report: dict[str, Any]) -> None:
    print(
        f"model: {report['model']}\n{report['architecture']} (plugin {report['plugin']}), "
        f"{report['modality']} items of {report['item']}, "
        f"{'uint8 pixels, device normalisation' if report['device_normalize'] else 'float32'}"
    )
    print(
        f"{report['requests']} requests per row, {report['callers']} caller threads for "
        "throughput; cache off\n"
    )
    print(f"{'workers':>7}  {'p50 ms':>8}  {'p95 ms':>8}  {'req/s':>8}  {'vs first':>8}  path")
    base = report["rows"][0]["throughput_rps"]
    for row in report["rows"]:
        print(
            f"{row['workers']:>7}  {row['latency_p50_ms']:>8.1f}  {row['latency_p95_ms']:>8.1f}  "
            f"{row['throughput_rps']:>8.1f}  {row['throughput_rps'] / base:>7.2f}x  {row['path']}"
        )
    cache, wire = report["cache"], report["wire"]
    miss = cache["cache_miss_p50_ms"]
    print(
        f"\ncache (p50, one worker): miss {miss:.2f} ms; hit {cache['cache_hit_p50_ms']:.3f} ms "
        f"by content hash ({miss / cache['cache_hit_p50_ms']:.1f}x), "
        f"{cache['cache_id_hit_p50_ms']:.3f} ms by caller id "
        f"({miss / cache['cache_id_hit_p50_ms']:.1f}x)"
    )
    print(
        f"wire: {wire['wire_bytes'] / 2**20:.2f} MiB in {wire['wire_frames']} frames per "
        f"request; encode_request {wire['encode_request_us']:.1f} us, decode_request "
        f"{wire['decode_request_us']:.1f} us"
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status."""
    from mmproc.errors import ConfigurationError
    from mmproc.factory import get_processor

    if args.list:
        print(describe_demo_models())
        return 0
    options: dict[str, Any] = dict(args.option)
    for managed, how in _MANAGED_OPTIONS.items():
        if managed in options:
            raise ConfigurationError(f"mmproc bench sets {managed} itself: {how}")
    for name, flag, given in (
        ("backend", "--backend", args.backend is not None),
        ("worker_kind", "--worker-kind", args.worker_kind is not None),
        ("device_normalize", "--no-device-normalize", args.no_device_normalize),
    ):
        if given and name in options:
            raise ConfigurationError(f"{name} given twice: as {flag} and as --option {name}=")
    if args.backend is not None:
        options["backend"] = args.backend
    if args.worker_kind is not None:
        options["worker_kind"] = args.worker_kind
    if args.no_device_normalize:
        options["device_normalize"] = False
    items = _items(args)
    with tempfile.TemporaryDirectory(prefix="mmproc-bench-") as tmp:
        folder, described = open_model(args.model, Path(tmp))
        rows = [_measure_workers(folder, options, w, args, items) for w in args.workers]
        wire = _measure_cache_and_wire(folder, options, args, items)
        stages = _measure_stages(folder, options, args, items) if args.stages else None
        with get_processor(folder, workers=1, warm_up=False, **options) as proc:
            architecture, plugin = proc.ctx.architecture, proc.ctx.plugin
    item = {
        "image": f"{args.size[0]}x{args.size[1]}",
        "video": f"{args.frames}x{args.size[0]}x{args.size[1]}",
        "audio": f"{args.seconds} s",
    }[args.modality]
    if args.encoded:
        item += {"image": " as PNG", "video": " as mp4", "audio": " as WAV"}[args.modality]
    report = {
        "model": described,
        "architecture": architecture,
        "plugin": plugin,
        "modality": args.modality,
        "item": item,
        "device_normalize": rows[0]["device_normalize"],
        "requests": args.requests,
        "callers": args.callers,
        "rows": rows,
        "cache": {k: v for k, v in wire.items() if k.startswith("cache")},
        "wire": {k: v for k, v in wire.items() if not k.startswith("cache")},
    }
    if stages is not None:
        report["stages"] = stages
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
        if stages is not None:
            _print_stages(stages)
    return 0
