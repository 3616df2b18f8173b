"""Qwen2-VL image preprocessing on the CPU: transformers against mmproc's uint8 fast paths.

Rows per image size, PIL backend:

- ``hf full``: ``Qwen2VLImageProcessorPil`` as loaded from a Qwen2-VL folder (resize, rescale,
  normalise, patchify; float32 out) -- what an engine runs without device normalisation;
- ``hf raw``: the same with ``do_rescale=False, do_normalize=False`` (still float32 inside);
- ``fast uint8``: ``mmproc_qwen_vl.image_fast_path.patchify_uint8`` (same Pillow resize, uint8
  patchify);

and torchvision backend (``Qwen2VLImageProcessor``, the default; its resize differs from
Pillow's, so these values are not comparable with the rows above bit for bit), called with
``device="cpu"`` as mmproc calls it:

- ``tv full``: resize, rescale, normalise, patchify; float32 out;
- ``tv raw``: ``do_rescale=False, do_normalize=False``; uint8 out;
- ``tv native``: ``mmproc_qwen_vl.torch_fast_path.patchify_uint8_torch`` (same torchvision resize
  on the same uint8 tensor, uint8 patchify).

Times are per image, the minimum over ``--repeats`` runs (CPU time of this process and wall time),
single-threaded torch. ``vs fast`` is a row's CPU time over its backend's fast path (``fast
uint8`` or ``tv native``). The last columns check each fast path: bit-identical to its ``raw``
row (cast to uint8), and the largest difference between ``FusedInputNorm`` applied to its uint8
patches and its ``full`` row's float32 values.
``--pillow-blocks N`` lets Pillow reuse freed image memory, in every path alike (it saves the page
faults of the fresh images each resize allocates).

Run: ``PYTHONPATH=plugins/qwen_vl .venv/bin/python benchmarks/qwen_fast_path.py``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mmproc.fused_norm import FusedInputNorm
from mmproc.norm_spec import ChannelLayout, NormSpec
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from mmproc_qwen_vl.image_fast_path import patch_settings_from_processor, patchify_uint8
from mmproc_qwen_vl.torch_fast_path import patchify_uint8_torch, torch_patch_settings
from PIL import Image
from transformers import AutoImageProcessor


def measure(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Minimum CPU and wall milliseconds of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    best_cpu = best_wall = float("inf")
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    return best_cpu * 1e3, best_wall * 1e3


def photo(width: int, height: int) -> Image.Image:
    """Noise over a gradient: resampling costs the same for any content; this checks values."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256])
    pixels = np.clip(base.transpose(1, 2, 0) + rng.integers(-40, 41, (height, width, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8))


def report(
    size: str,
    *,
    pil: Any,
    tv: Any,
    settings: dict[str, int],
    norm: FusedInputNorm,
    repeats: int,
) -> None:
    """Print the table rows of one image size."""
    width, height = (int(v) for v in size.lower().split("x"))
    image = photo(width, height)

    full = np.asarray(pil(image)["pixel_values"])
    raw = np.asarray(pil(image, do_rescale=False, do_normalize=False)["pixel_values"])
    fast, _ = patchify_uint8(image, **settings)
    identical = np.array_equal(fast, raw.astype(np.uint8)) and np.array_equal(fast, raw)
    diff = float((norm(torch.from_numpy(fast)) - torch.from_numpy(full)).abs().max())

    tv_settings = torch_patch_settings(tv)
    tv_full = tv(image, device="cpu")["pixel_values"]
    tv_raw = tv(image, device="cpu", do_rescale=False, do_normalize=False)["pixel_values"]
    tv_fast, _ = patchify_uint8_torch(image, **tv_settings)
    tv_identical = tv_raw.dtype == torch.uint8 and torch.equal(tv_fast, tv_raw)
    tv_diff = float((norm(tv_fast) - tv_full).abs().max())

    groups = [
        (
            [
                ("hf full", lambda: pil(image)),
                ("hf raw", lambda: pil(image, do_rescale=False, do_normalize=False)),
                ("fast uint8", lambda: patchify_uint8(image, **settings)),
            ],
            identical,
            diff,
        ),
        (
            [
                ("tv full", lambda: tv(image, device="cpu")),
                (
                    "tv raw",
                    lambda: tv(image, device="cpu", do_rescale=False, do_normalize=False),
                ),
                ("tv native", lambda: patchify_uint8_torch(image, **tv_settings)),
            ],
            tv_identical,
            tv_diff,
        ),
    ]
    for rows, same, error in groups:
        times = {name: measure(fn, repeats) for name, fn in rows}
        fast_name = rows[-1][0]
        fast_cpu = times[fast_name][0]
        for name, (cpu, wall) in times.items():
            checks = f" {same!s:>14} {error:>21.2e}" if name == fast_name else ""
            print(f"{size:>10} {name:<15} {cpu:>8.2f} {wall:>8.2f} {cpu / fast_cpu:>7.2f}x{checks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", default="1024x768,1920x1080", help="WxH,WxH,...")
    parser.add_argument(
        "--pillow-blocks",
        type=int,
        default=None,
        help="let Pillow keep this many freed memory blocks (both paths; default: Pillow's, 0)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.pillow_blocks is not None:
        # Pillow frees every image's memory by default, so each resize page-faults its fresh
        # intermediate and output images; a block cache saves that in every path alike.
        Image.core.set_blocks_max(args.pillow_blocks)
    print(
        f"Pillow blocks_max={Image.core.get_blocks_max()}, torch threads=1, min of {args.repeats}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_qwen2_vl_folder(Path(tmp))
        pil = AutoImageProcessor.from_pretrained(folder, local_files_only=True, backend="pil")
        tv = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    settings = patch_settings_from_processor(pil)
    norm = FusedInputNorm(
        NormSpec.from_image_processor(
            pil,
            layout=ChannelLayout.flat_patches(
                patch_size=settings["patch_size"],
                temporal_patch_size=settings["temporal_patch_size"],
            ),
        ),
        dtype=torch.float32,
    )

    header = (
        f"{'image':>10} {'path':<15} {'cpu ms':>8} {'wall ms':>8} {'vs fast':>8}"
        f" {'bit-identical':>14} {'max|diff| after norm':>21}"
    )
    print(header)
    print("-" * len(header))
    for size in args.sizes.split(","):
        report(size, pil=pil, tv=tv, settings=settings, norm=norm, repeats=args.repeats)


if __name__ == "__main__":
    main()
