"""What one request costs in mmproc over the bare HF processor call, and next to vLLM's processor.

For the Qwen2-VL demo model, images of 1024x768 and 1920x1080, both image backends, float32
pixels (``device_normalize=False``) and uint8 pixels (device normalisation), one worker, cache
off, one request at a time, it times:

- ``bare HF``: the plugin's ``process_mm_data`` on the caller's thread with the keyword
  arguments the pipeline passes (``Processor.hf_call_kwargs``), on already-loaded items: the
  processor call mmproc cannot avoid;
- ``mmproc``: ``Processor.process`` on the same image (a PIL image, as a caller holds it);
- ``vLLM``, with ``--vllm PYTHON`` (the peer environment's interpreter, see
  ``../shared/peer/README.md``): vLLM 0.33's multimodal processor for the same folder and the
  same images, in its own process (torchvision rows only: vLLM loads that backend).

Each configuration alternates the sides request by request (vLLM's in chunks, in its process,
never at the same time as mmproc's), over ``--rounds`` rounds of ``--requests`` requests, and
shows medians. Targets: mmproc's cost over the bare call at most 5 ms or 10 % of it, whichever is
larger, on every row; and one worker at 1024x768, torchvision, float32 no slower than vLLM's
14.1 ms (the figure of the issue; vLLM's own measured figure when ``--vllm`` is given).

torch runs with its default intra-op threads (all cores) on every side; run with
``OMP_NUM_THREADS=1`` for one thread. The two sides may run different transformers versions
(vLLM's peer pins its own), whose image processors differ in speed; to compare on one version,
run this script with the peer's interpreter and mmproc on the path (the qwen_vl plugin is then
registered in-process): ``PYTHONPATH=core:plugins/qwen_vl PEER/bin/python benchmarks/overhead.py
--vllm PEER/bin/python`` (the peer needs ``pip install pluggy xxhash`` for mmproc).

Run: ``.venv/bin/python benchmarks/overhead.py [--requests 16] [--rounds 3] [--vllm PYTHON]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import mmproc
import torch
from mmproc.context import ProcessingMode
from mmproc.demo import demo_image
from mmproc.demo_models import open_model
from mmproc.inputs import parse_mm_data
from PIL import Image

SIZES = ((1024, 768), (1920, 1080))
VLLM_TARGET_MS = 14.1  # vLLM 0.33, 1024x768, torchvision, float32, 2 torch threads (the issue)

# The vLLM side: a process in the peer environment that answers one JSON line per command.
VLLM_SERVER = textwrap.dedent(
    """
    import json, sys, time
    from PIL import Image
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    folder, prompt = sys.argv[1], sys.argv[2]
    processors = {}

    def processor(uint8):
        if uint8 not in processors:
            config = ModelConfig(
                model=folder, tokenizer=folder, dtype="float32", seed=0,
                limit_mm_per_prompt={"image": 2}, mm_processor_cache_gb=0,
                mm_device_do_normalize=uint8,
            )
            processors[uint8] = MULTIMODAL_REGISTRY.create_processor(config)
        return processors[uint8]

    import transformers, vllm
    print(json.dumps({"versions": f"vLLM {vllm.__version__} on transformers "
                      f"{transformers.__version__}"}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        proc = processor(command["uint8"])
        images = []
        for path in command["images"]:
            image = Image.open(path)
            image.load()
            images.append(image)
        seconds = []
        for image in images:
            start = time.perf_counter()
            items = proc.info.parse_mm_data({"image": [image]})
            proc(prompt, mm_items=items, hf_processor_mm_kwargs={}, cache=None)
            seconds.append(time.perf_counter() - start)
        print(json.dumps({"seconds": seconds}), flush=True)
    """
)


class VllmSide:
    """vLLM's processor in the peer environment's interpreter, driven over stdin / stdout."""

    def __init__(self, python: str, folder: Path, prompt: str) -> None:
        self._process = subprocess.Popen(
            [python, "-c", VLLM_SERVER, str(folder), prompt],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.versions = self._read()["versions"]

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM side exited ({self._process.wait()})")
        return json.loads(line)

    def time(self, images: list[Path], uint8: bool) -> list[float]:
        assert self._process.stdin is not None
        command = {"images": [str(p) for p in images], "uint8": uint8}
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        return self._read()["seconds"]

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(30)


def _registry() -> Any:
    """The process's registry when the qwen_vl plugin is installed; else (run from another
    environment with the plugin on PYTHONPATH) one holding it in-process."""
    from mmproc.registry import PluginStatus, Registry, get_registry

    registry = get_registry()
    if any(p.name == "qwen_vl" and p.status == PluginStatus.LOADED for p in registry.plugins()):
        return registry
    import mmproc_qwen_vl.plugin

    registry = Registry(entry_points=False)
    registry.add_plugin(mmproc_qwen_vl.plugin, name="qwen_vl")
    return registry


def _measure(
    folder: Path,
    backend: str,
    uint8: bool,
    paths: list[Path],
    args: argparse.Namespace,
    vllm: VllmSide | None,
) -> dict[str, Any]:
    images = []
    for path in paths:
        image = Image.open(path)
        image.load()
        images.append(image)
    with mmproc.get_processor(
        folder,
        registry=_registry(),
        workers=1,
        cache_bytes=0,
        warm_up=True,
        backend=backend,
        device_normalize=uint8,
    ) as proc:
        assert (proc.norm_spec is not None) == uint8, "device normalisation not as asked"
        prompt = proc.model.get_dummy_text(proc.ctx, {"image": 1})
        kwargs = proc.hf_call_kwargs()
        mode = ProcessingMode(media_only=True, raw_pixels=uint8, device=proc.device, user_kwargs={})
        loaded = [parse_mm_data({"image": [image]}, media=proc.media) for image in images]
        proc.process(prompt, {"image": [images[0]]})  # first-call costs
        bare: list[float] = []
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(args.rounds):
            for index in range(args.requests):
                image, mm_items = images[index % len(images)], loaded[index % len(images)]
                start = time.perf_counter()
                proc.model.process_mm_data(
                    proc.ctx, mode, prompt, mm_items, proc.hf_processor, kwargs
                )
                bare.append(time.perf_counter() - start)
                start = time.perf_counter()
                proc.process(prompt, {"image": [image]})
                ours.append(time.perf_counter() - start)
            if vllm is not None and backend == "torchvision":
                rotation = [paths[i % len(paths)] for i in range(args.requests)]
                theirs += vllm.time(rotation, uint8)
    bare_ms = statistics.median(bare) * 1e3
    ours_ms = statistics.median(ours) * 1e3
    return {
        "bare_ms": bare_ms,
        "mmproc_ms": ours_ms,
        "vllm_ms": statistics.median(theirs) * 1e3 if theirs else None,
        "overhead_ms": ours_ms - bare_ms,
        "target_ms": max(5.0, 0.1 * bare_ms),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=4, help="distinct images per size")
    parser.add_argument("--vllm", metavar="PYTHON", help="the vLLM peer environment's python")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmproc-overhead-") as tmp:
        folder, described = open_model("demo:qwen2-vl", Path(tmp), _registry())
        paths: dict[tuple[int, int], list[Path]] = {}
        for size in SIZES:
            paths[size] = []
            for seed in range(args.images):
                path = Path(tmp) / f"image-{size[0]}x{size[1]}-{seed}.png"
                demo_image(seed, size).save(path)
                paths[size].append(path)
        vllm = None
        if args.vllm:
            with mmproc.get_processor(
                folder, registry=_registry(), workers=1, warm_up=False
            ) as proc:
                prompt = proc.model.get_dummy_text(proc.ctx, {"image": 1})
            vllm = VllmSide(args.vllm, folder, prompt)
        try:
            for size in SIZES:
                for backend in ("pil", "torchvision"):
                    for uint8 in (False, True):
                        row = _measure(folder, backend, uint8, paths[size], args, vllm)
                        row.update(
                            size=f"{size[0]}x{size[1]}",
                            backend=backend,
                            pixels="uint8" if uint8 else "float32",
                        )
                        rows.append(row)
        finally:
            if vllm is not None:
                vllm.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    import transformers

    if vllm is not None:
        described += f"; {vllm.versions}"
    print(
        f"{described}\none worker, cache off, torch {torch.get_num_threads()} intra-op threads, "
        f"mmproc on transformers {transformers.__version__}; median ms of {args.rounds} x "
        f"{args.requests} requests per side"
    )
    header = (
        f"{'size':<10} {'backend':<12} {'pixels':<8} {'bare HF':>8} {'mmproc':>8} "
        f"{'vLLM':>8} {'over':>7} {'target':>7}  verdict"
    )
    print(header)
    for row in rows:
        vllm_ms = f"{row['vllm_ms']:8.2f}" if row["vllm_ms"] is not None else f"{'-':>8}"
        verdict = "met" if row["overhead_ms"] <= row["target_ms"] else "MISSED"
        print(
            f"{row['size']:<10} {row['backend']:<12} {row['pixels']:<8} {row['bare_ms']:8.2f} "
            f"{row['mmproc_ms']:8.2f} {vllm_ms} {row['overhead_ms']:+7.2f} "
            f"{row['target_ms']:7.1f}  {verdict}"
        )
    reference = next(
        r
        for r in rows
        if (r["size"], r["backend"], r["pixels"]) == ("1024x768", "torchvision", "float32")
    )
    bar = reference["vllm_ms"] or VLLM_TARGET_MS
    source = "measured here" if reference["vllm_ms"] else "the issue's figure"
    verdict = "met" if reference["mmproc_ms"] <= bar else "MISSED"
    print(
        f"one worker, 1024x768 torchvision float32: mmproc {reference['mmproc_ms']:.2f} ms vs "
        f"vLLM {bar:.2f} ms ({source}): {verdict}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
