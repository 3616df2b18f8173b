"""Benchmark: device-side normalisation (issue 6).

Prints three tables:

1. CPU time per image through Qwen2-VL's HF image processor (PIL and torchvision backends, three
   image sizes): the float path (rescale and normalise on the CPU) against ``device_normalize``
   (the processor with rescale and normalise off, then ``to_uint8_pixels``), and the bytes each
   puts on the wire.
2. ``FusedInputNorm`` on ``--device`` against the unfused three-step reference (``/255``, ``-mean``,
   ``/std``, then the cast), in ms, elements per second and GB/s (bytes read plus bytes written).
3. With ``--device cuda``: host-to-device copy of the pixels from pinned memory, uint8 against
   float32.

Run: ``.venv/bin/python benchmarks/fused_norm.py [--device cuda] [--repeat 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from mmproc.fused_norm import FusedInputNorm, raw_pixel_kwargs, to_uint8_pixels
from mmproc.norm_spec import ChannelLayout, NormSpec
from PIL import Image
from transformers.image_utils import PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

# Qwen2-VL's preprocessor_config.json settings
QWEN2_VL = dict(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=3136,
    max_pixels=12845056,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
    resample=PILImageResampling.BICUBIC,
)
BACKENDS = {"pil": Qwen2VLImageProcessorPil, "torchvision": Qwen2VLImageProcessor}
LAYOUT = ChannelLayout.flat_patches(patch_size=14, temporal_patch_size=2)


def make_image(width: int, height: int) -> Image.Image:
    """A gradient plus noise: smooth areas and edges, like a photo as far as resizing cares."""
    rng = np.random.default_rng(width * 7919 + height)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    noise = rng.normal(0, 40, size=(height, width, 3))
    return Image.fromarray(np.clip(ramp + noise, 0, 255).astype(np.uint8), "RGB")


def median_ms(
    fns: list[Callable[[], object]], repeat: int, sync: Callable[[], None] = lambda: None
) -> list[float]:
    """Median wall time of each of ``fns`` in milliseconds, after one untimed warm-up call each.

    The functions take turns, round after round, so a noisy neighbour on a shared machine slows
    all of them alike rather than whichever happened to run at the time.
    """
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    sync()
    for _ in range(repeat):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            sync()
            spent.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def cpu_preprocessing(sizes: list[tuple[int, int]], repeat: int) -> None:
    rows = []
    for backend, cls in BACKENDS.items():
        ip = cls(**QWEN2_VL)
        for width, height in sizes:
            img = make_image(width, height)

            def float_path(ip=ip, img=img) -> torch.Tensor:
                return ip(images=img, return_tensors="pt")["pixel_values"]

            def uint8_path(ip=ip, img=img) -> torch.Tensor | None:
                raw = ip(images=img, return_tensors="pt", **raw_pixel_kwargs())
                return to_uint8_pixels(raw["pixel_values"])

            f32 = float_path()
            u8 = uint8_path()
            if u8 is None:
                raise SystemExit(f"{backend}: raw pixels are not whole numbers in [0, 255]")
            t_float, t_uint8 = median_ms([float_path, uint8_path], repeat)
            rows.append(
                [
                    backend,
                    f"{width}x{height}",
                    f"{t_float:.1f}",
                    f"{t_uint8:.1f}",
                    f"{t_float / t_uint8:.2f}x",
                    f"{f32.nbytes / 1e6:.2f}",
                    f"{f32.nbytes / 2e6:.2f}",
                    f"{u8.nbytes / 1e6:.2f}",
                    f"{f32.nbytes / u8.nbytes:.0f}x",
                ]
            )
    print_table(
        "1. CPU time per image, Qwen2-VL image processor (ms, median), and bytes on the wire (MB)",
        [
            "backend",
            "size",
            "float path",
            "device_normalize",
            "speedup",
            "float32 MB",
            "(bf16 MB)",
            "uint8 MB",
            "fewer bytes",
        ],
        rows,
    )


def device_norm(device: torch.device, num_images: int, size: tuple[int, int], repeat: int) -> None:
    ip = Qwen2VLImageProcessor(**QWEN2_VL)
    raw = ip(images=make_image(*size), return_tensors="pt", **raw_pixel_kwargs())["pixel_values"]
    pixels = to_uint8_pixels(raw)
    if pixels is None:
        raise SystemExit("raw pixels are not whole numbers in [0, 255]")
    x = pixels.repeat(num_images, 1).to(device)
    spec = NormSpec.from_image_processor(ip, layout=LAYOUT)
    fused_bf16 = FusedInputNorm(spec, device=device)
    fused_f32 = FusedInputNorm(spec, dtype=torch.float32, device=device)
    # the unfused reference, as CPU-side code does it: rescale, subtract, divide, cast
    block = LAYOUT.block
    mean = torch.tensor(spec.mean, device=device).repeat_interleave(block)
    std = torch.tensor(spec.std, device=device).repeat_interleave(block)

    def three_step(dtype: torch.dtype) -> torch.Tensor:
        y = ((x.to(torch.float32) * spec.rescale) - mean) / std
        return y.to(dtype)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = x.numel()
    ops = [
        ("FusedInputNorm uint8 -> bf16", lambda: fused_bf16(x), 2),
        ("three-step uint8 -> bf16", lambda: three_step(torch.bfloat16), 2),
        ("FusedInputNorm uint8 -> fp32", lambda: fused_f32(x), 4),
        ("three-step uint8 -> fp32", lambda: three_step(torch.float32), 4),
    ]
    times = median_ms([fn for _, fn, _ in ops], repeat, sync)
    rows = [
        [name, f"{ms:.3f}", f"{n / ms / 1e6:.2f}", f"{n * (1 + out_bytes) / ms / 1e6:.2f}"]
        for (name, _, out_bytes), ms in zip(ops, times, strict=True)
    ]
    print_table(
        f"2. Normalisation on {device} ({num_images} x {size[0]}x{size[1]} image, "
        f"{tuple(x.shape)} uint8, {torch.get_num_threads()} CPU threads)",
        ["op", "ms", "Gelem/s", "GB/s (in+out)"],
        rows,
    )


def host_to_device(
    device: torch.device, num_images: int, size: tuple[int, int], repeat: int
) -> None:
    ip = Qwen2VLImageProcessor(**QWEN2_VL)
    f32 = ip(images=make_image(*size), return_tensors="pt")["pixel_values"].repeat(num_images, 1)
    raw = ip(images=make_image(*size), return_tensors="pt", **raw_pixel_kwargs())["pixel_values"]
    pixels = to_uint8_pixels(raw)
    if pixels is None:
        raise SystemExit("raw pixels are not whole numbers in [0, 255]")
    hosts = {"uint8": pixels.repeat(num_images, 1).pin_memory(), "float32": f32.pin_memory()}
    copies = [lambda h=h: h.to(device, non_blocking=True) for h in hosts.values()]
    times = median_ms(copies, repeat, torch.cuda.synchronize)
    rows = [
        [name, f"{h.nbytes / 1e6:.1f}", f"{ms:.3f}", f"{h.nbytes / ms / 1e6:.1f}"]
        for (name, h), ms in zip(hosts.items(), times, strict=True)
    ]
    print_table(
        f"3. Host to {device} copy from pinned memory ({num_images} x {size[0]}x{size[1]} image)",
        ["dtype", "MB", "ms", "GB/s"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="device for table 2: cpu or cuda")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per cell (median)")
    parser.add_argument(
        "--sizes",
        default="640x480,1024x768,1920x1080",
        help="image sizes for table 1, WIDTHxHEIGHT, comma separated",
    )
    parser.add_argument(
        "--images", type=int, default=None, help="1920x1080 images per batch in tables 2 and 3"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--skip-cpu", action="store_true", help="skip table 1")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")

    if not args.skip_cpu:
        cpu_preprocessing(sizes, args.repeat)  # type: ignore[arg-type]
    images = args.images or (16 if device.type == "cuda" else 1)
    device_norm(device, images, (1920, 1080), args.repeat)
    if device.type == "cuda":
        host_to_device(device, images, (1920, 1080), args.repeat)


if __name__ == "__main__":
    main()
