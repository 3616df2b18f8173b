"""``mmproc demo``: the main job, end to end, on a plugin's demo model (or any model folder).

A demo model is a tiny local folder a plugin writes (``--model demo:NAME``; ``--list`` shows
them): the model's real special tokens and preprocessor settings, no weights, no hub. The demo
then does what a serving front end does:

1. preprocess two bursts of requests concurrently on the worker pool (``process_async``); the
   second repeats the first's media, so the processor-output cache serves them;
2. send each processed request to an "engine" over ZMQ ``ipc://`` with big tensors in zero-copy
   frames;
3. on the engine side, decode the features and make model inputs of them (uint8 pixels are
   normalised by ``FusedInputNorm``).

It prints one row per request and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mmproc.demo_models import add_model_arguments, describe_demo_models, open_model

__all__ = [
    "add_arguments",
    "demo_audio",
    "demo_file",
    "demo_image",
    "demo_item",
    "demo_video",
    "run_demo",
]

DEMO_SIZES = ((1024, 768), (640, 480), (800, 600), (1280, 720))
_QUESTIONS = {"image": "picture", "video": "video", "audio": "recording"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``mmproc demo`` options."""
    add_model_arguments(parser)
    parser.add_argument("--requests", type=int, default=8, help="requests to send (default 8)")
    parser.add_argument(
        "--modality",
        choices=("image", "video", "audio"),
        default=None,
        help="media to send (default: the first the model takes)",
    )
    parser.add_argument(
        "--backend",
        choices=("pil", "torchvision"),
        default=None,
        help="image backend, for models whose plugin offers one",
    )
    parser.add_argument("--workers", type=int, default=None, help="preprocessing workers")
    parser.add_argument(
        "--no-device-normalize",
        action="store_true",
        help="normalise on the CPU and ship float32 instead of uint8",
    )


def demo_image(seed: int, size: tuple[int, int]) -> Any:
    """A picture with gradients and shapes (resizing real structure, not noise)."""
    import numpy as np
    from PIL import Image, ImageDraw

    width, height = size
    x = np.linspace(0, 255, width, dtype=np.float32)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    rgb = np.stack(
        [(x + seed * 40) % 256 + 0 * y, (y + seed * 70) % 256 + 0 * x, (x + y) / 2], axis=-1
    )
    image = Image.fromarray(rgb.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for k in range(6):
        cx, cy = (seed * 97 + k * 131) % width, (seed * 53 + k * 89) % height
        r = 20 + (seed + k) % 5 * 15
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=((k * 60) % 256, 200, 90))
    return image


def demo_video(seed: int, size: tuple[int, int], frames: int) -> Any:
    """``frames`` demo pictures as one ``(T, H, W, 3)`` uint8 video."""
    import numpy as np

    return np.stack([np.asarray(demo_image(seed + t, size)) for t in range(frames)])


def demo_audio(seed: int, seconds: float, rate: int = 16000) -> tuple[Any, int]:
    """A tone (its pitch set by ``seed``) as ``(waveform, sample_rate)``."""
    import numpy as np

    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    return (0.3 * np.sin(2 * np.pi * (220 + 55 * seed) * t)).astype(np.float32), rate


def demo_file(modality: str, item: Any) -> bytes:
    """A demo item as the bytes of a file: a PNG, an mp4 at 2 fps (H.264), a float WAV."""
    import io

    buffer = io.BytesIO()
    if modality == "image":
        item.save(buffer, format="PNG")
    elif modality == "video":
        import av

        frames = item[:, : item.shape[1] // 2 * 2, : item.shape[2] // 2 * 2]  # even, for 4:2:0
        with av.open(buffer, mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=2)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
    else:
        import soundfile

        waveform, rate = item
        soundfile.write(buffer, waveform, rate, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def demo_item(modality: str, seed: int) -> Any:
    """One demo item of ``modality``, of the demo's sizes."""
    size = DEMO_SIZES[seed % len(DEMO_SIZES)]
    if modality == "image":
        return demo_image(seed, size)
    if modality == "video":
        return demo_video(seed, (size[0] // 4, size[1] // 4), frames=4)
    return demo_audio(seed, seconds=2 + seed)


def _engine(address: str, expected: int, results: dict[str, Any], ready: threading.Event) -> None:
    """The receiving side: decode requests and make model inputs on the engine's device."""
    import torch

    from mmproc.engine import prepare_request
    from mmproc.wire import RequestReceiver

    with RequestReceiver(address) as receiver:
        ready.set()
        while len(results) < expected:
            request = receiver.recv(timeout=60)
            if request is None:
                break
            start = time.perf_counter()
            inputs = prepare_request(request, device="cpu", dtype=torch.bfloat16)
            results[request.request_id] = {
                "engine_ms": (time.perf_counter() - start) * 1e3,
                "dtypes": sorted({str(v.dtype) for i in inputs for v in i.values()}),
            }


async def _preprocess_all(processor: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    async def one(prompt: str, mm_data: dict[str, Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        out = await processor.process_async(prompt, mm_data)
        return out, (time.perf_counter() - start) * 1e3

    return await asyncio.gather(*(one(p, m) for p, m in requests))


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    if args.list:
        print(describe_demo_models())
        return 0
    from mmproc.errors import MediaItemError
    from mmproc.factory import get_processor
    from mmproc.wire import RequestSender

    with tempfile.TemporaryDirectory(prefix="mmproc-demo-") as tmp:
        folder, described = open_model(args.model, Path(tmp))
        options: dict[str, Any] = {}
        if args.backend is not None:
            options["backend"] = args.backend
        if args.workers is not None:
            options["workers"] = args.workers
        if args.no_device_normalize:
            options["device_normalize"] = False
        print(f"model: {described}")
        with get_processor(folder, warm_up=True, **options) as processor:
            print(f"processor: {processor!r}")
            modality = args.modality or (processor.modalities or ("image",))[0]
            if modality not in processor.modalities:
                raise MediaItemError(
                    modality, None, f"the model takes {', '.join(processor.modalities)} only"
                )
            # Items repeat across requests: the later requests are served by the cache.
            items = [demo_item(modality, seed) for seed in range(4)]
            if modality == "video":
                # Files, as videos come: the frame rate tells each frame's time (which some
                # models write into the prompt), and mmproc samples at the model's rate.
                items = [demo_file(modality, item) for item in items]
            requests = []
            for r in range(args.requests):
                count = 1 + r % 2
                chosen = [items[(r % 4 + k) % len(items)] for k in range(count)]
                placeholders = processor.model.get_dummy_text(processor.ctx, {modality: count})
                prompt = f"{placeholders}What is in this {_QUESTIONS[modality]}?"
                requests.append((prompt, {modality: chosen}))

            # Two bursts: the second repeats the first's media, so the cache serves them.
            half = (len(requests) + 1) // 2
            start = time.perf_counter()
            processed = asyncio.run(_preprocess_all(processor, requests[:half]))
            processed += asyncio.run(_preprocess_all(processor, requests[half:]))
            total_s = time.perf_counter() - start

            address = f"ipc://{tmp}/engine.sock"
            results: dict[str, Any] = {}
            ready = threading.Event()
            engine = threading.Thread(
                target=_engine, args=(address, len(processed), results, ready), daemon=True
            )
            engine.start()
            ready.wait(10)
            wire_bytes = {}
            with RequestSender(address) as sender:
                for i, (out, _) in enumerate(processed):
                    request = out.to_engine_request(f"req-{i}", {"max_tokens": 64})
                    # What left: the msgpack body plus the tensor frames, or a reference for
                    # an item the engine already holds.
                    sent_before = sender.stats.bytes
                    sender.send(request)
                    wire_bytes[request.request_id] = sender.stats.bytes - sent_before
                    # Acknowledged before the next is sent, so a repeated picture goes as a
                    # reference to what the engine holds.
                    sender.flush(timeout=30)
                wire = sender.stats
            engine.join(60)

            print()
            print(
                f"{'request':<8} {'items':>5} {'prompt':>7} {'placeholders':<24} "
                f"{'preproc ms':>10} {'wire KiB':>9} {'engine ms':>9}  engine dtypes"
            )
            for i, (out, ms) in enumerate(processed):
                rid = f"req-{i}"
                ranges = ",".join(
                    f"{f.placeholder.offset}+{f.placeholder.length}" for f in out.features
                )
                got = results.get(rid, {})
                engine_ms = got.get("engine_ms", float("nan"))
                print(
                    f"{rid:<8} {len(out.features):>5} {len(out.prompt_token_ids):>7} {ranges:<24} "
                    f"{ms:>10.1f} {wire_bytes[rid] / 1024:>9.1f} {engine_ms:>9.1f}"
                    f"  {', '.join(got.get('dtypes', ['(not received)']))}"
                )
            stats = processor.cache.stats()
            shipped = "uint8 pixels" if processor.norm_spec else "no uint8 pixels (CPU-normalised)"
            print()
            print(
                f"{len(processed)} {modality} requests preprocessed in {total_s * 1e3:.0f} ms "
                f"({len(processed) / total_s:.1f} req/s) on {processor.workers} worker(s), "
                f"{processor.path} path; cache {stats.hits} hits / {stats.misses} misses; "
                f"{shipped}; {len(results)}/{len(processed)} received and prepared by the engine; "
                f"items sent in full {wire.items_in_full}, by reference {wire.items_by_reference}"
            )
            return 0 if len(results) == len(processed) else 1
