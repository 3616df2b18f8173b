"""Qwen2-VL image patches in uint8, bit-identical to transformers' PIL backend, without floats.

With device-side normalisation the CPU only has to resize and cut the image into patches; the
engine applies ``FusedInputNorm`` (``x * rescale / std - mean / std``) to the uint8 patches. The
PIL backend of transformers (``Qwen2VLImageProcessorPil``, 5.x) does, per image:

1. convert to RGB: an image with an alpha band or a ``transparency`` key is converted to RGBA and
   alpha-composited onto opaque white, any other is ``Image.convert("RGB")``; then
   ``np.array`` (H, W, 3) uint8 and a move to channels-first;
2. resize: back to a PIL image (``Image.fromarray`` of the same uint8 pixels, so the same image)
   and ``Image.resize((w, h), resample)`` with the size from ``smart_resize``; the filter runs in
   Pillow on uint8 pixels and rounds to uint8 there, so no float rounding of ours is involved;
3. rescale and normalise in float (skipped with ``do_rescale=False, do_normalize=False``);
4. patchify: ``np.asarray(image, float32)``, reshape into merge windows of patches, repeat the
   single frame ``temporal_patch_size`` times, flatten to ``(patches, C * T * P * P)``.

Steps 1 and 2 here are the very same Pillow calls; step 4 is the same reordering done on uint8.
The values of step 3's input are integers 0..255 held exactly in float32, so these patches equal
transformers' raw ``pixel_values`` cast to uint8, bit for bit, and float work is left to the device.
Besides the resize (about 80% of the time left), the only work is one gather into patch order
and one copy that repeats it for each frame; the resized pixels are read in place where Pillow
can export them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
from mmproc.plugin import output_tensor, rgb_pixels
from PIL import Image

__all__ = [
    "MAX_ASPECT_RATIO",
    "QWEN2_VL_PATCH_SETTINGS",
    "ImageSizeError",
    "copy_patches",
    "image_token_count",
    "patch_settings_from_processor",
    "patchify_uint8",
    "smart_resize",
    "to_rgb",
]

# transformers' smart_resize refuses images whose long side exceeds 200 times the short side.
MAX_ASPECT_RATIO = 200

# The settings of the Qwen2-VL / Qwen2.5-VL hub checkpoints; the defaults of `patchify_uint8`.
QWEN2_VL_PATCH_SETTINGS: Mapping[str, int] = MappingProxyType(
    {
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": 14 * 14 * 4 * 16384,
        "resample": int(Image.Resampling.BICUBIC),
    }
)

_CHANNELS = 3


class ImageSizeError(ValueError):
    """An image's size cannot be processed: a side not positive, or too extreme an aspect ratio.

    A ``ValueError``, as transformers raises for the same images: the core names the request's
    item at fault, as for any processor failure. From `patchify_uint8`, ``index`` is the item's
    position in the batch (and starts the message).
    """

    def __init__(self, message: str, *, height: int, width: int, index: int | None = None) -> None:
        super().__init__(message if index is None else f"image {index}: {message}")
        self.height = height
        self.width = width
        self.index = index


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) transformers' Qwen2-VL processor resizes an image of this size to.

    Both sides become multiples of ``factor`` (patch size x merge size), as close to the original
    aspect ratio as that allows, with the area brought inside ``[min_pixels, max_pixels]``. The
    arithmetic is transformers' own, step for step (Python's ``round`` halves to even), so the
    sizes agree for every input.

    Raises:
        ImageSizeError: a side is not positive, or the long side is more than
            `MAX_ASPECT_RATIO` (200) times the short one (exactly 200:1 is accepted).
    """
    if height <= 0 or width <= 0:
        raise ImageSizeError(
            f"image of {width}x{height} pixels (width x height): both sides must be positive",
            height=height,
            width=width,
        )
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageSizeError(
            f"image of {width}x{height} pixels (width x height) has an aspect ratio of "
            f"{ratio:g}:1; the Qwen2-VL processor accepts at most {MAX_ASPECT_RATIO}:1",
            height=height,
            width=width,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_token_count(
    height: int,
    width: int,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 16384,
) -> int:
    """The number of placeholder tokens an image of this size expands to, without processing it.

    Equal to ``image_grid_thw.prod() // merge_size**2`` of the processed image (one frame).
    """
    resized_h, resized_w = smart_resize(
        height, width, factor=patch_size * merge_size, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return (resized_h // patch_size) * (resized_w // patch_size) // (merge_size * merge_size)


def patch_settings_from_processor(image_processor: Any) -> dict[str, int]:
    """The `patchify_uint8` keyword arguments that reproduce ``image_processor``'s output.

    Accepts a Qwen2-VL image processor of either backend, or a full processor (its
    ``image_processor`` is used); anything with the same attributes works: ``patch_size``,
    ``temporal_patch_size``, ``merge_size``, ``size`` with ``shortest_edge`` / ``longest_edge``,
    ``resample``.

    Raises:
        ValueError: the processor does not resize, does not convert to RGB, or resamples with a
            filter that is not a Pillow one; the fast path would not reproduce it.
    """
    ip = image_processor
    if not hasattr(ip, "patch_size") and hasattr(ip, "image_processor"):
        ip = ip.image_processor
    if getattr(ip, "do_resize", True) is False:
        raise ValueError("the uint8 fast path needs an image processor with do_resize=True")
    if getattr(ip, "do_convert_rgb", True) is False:
        raise ValueError("the uint8 fast path needs an image processor with do_convert_rgb=True")
    resample = ip.resample
    if resample is None:
        resample = Image.Resampling.BILINEAR  # what the PIL backend uses when unset
    try:
        resample = Image.Resampling(int(resample))
    except (TypeError, ValueError):
        raise ValueError(
            f"the uint8 fast path resizes with Pillow; {resample!r} is not a Pillow filter"
        ) from None
    size = ip.size
    return {
        "patch_size": int(ip.patch_size),
        "temporal_patch_size": int(ip.temporal_patch_size),
        "merge_size": int(ip.merge_size),
        "min_pixels": int(size["shortest_edge"]),
        "max_pixels": int(size["longest_edge"]),
        "resample": int(resample),
    }


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels exactly as transformers' PIL backend makes them (``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        # transformers converts (a copy) and rebuilds the image from the array; both keep the
        # pixels, and resize never writes to its input, so the copies are skipped.
        return image
    return image.convert("RGB")


def _write_patches(
    pixels: np.ndarray,
    out: np.ndarray,
    *,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
) -> None:
    """Write ``pixels`` (H, W, C) uint8 into ``out`` (patches, C*T*P*P) in transformers' order.

    Row order: merge windows row-major, then the ``merge_size`` x ``merge_size`` patches inside a
    window row-major; within a row: channel, frame (the one image repeated), patch row, column.
    """
    height, width, channels = pixels.shape
    p, m, t = patch_size, merge_size, temporal_patch_size
    grid_h, grid_w = height // p, width // p
    # (window row, window col, patch row in window, patch col in window, channel, y, x): a view.
    ordered = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels).transpose(
        0, 3, 1, 4, 6, 2, 5
    )
    copy_patches(ordered, out, temporal_patch_size=t, patch_size=p)


def copy_patches(
    ordered: np.ndarray, out: np.ndarray, *, temporal_patch_size: int, patch_size: int
) -> None:
    """Write patch-ordered pixels ``(..., C, y, x)`` into ``out``, each frame ``T`` times.

    Shared by both backends' native paths once their pixels are viewed in patch order.
    """
    t, p = temporal_patch_size, patch_size
    if t == 1:
        np.copyto(out.reshape(ordered.shape), ordered)
        return
    # Two passes beat one strided gather straight into the T-times larger output: gather once
    # into patch order, then copy it T times with contiguous inner runs.
    gathered = np.ascontiguousarray(ordered).reshape(-1, 1, p * p)
    np.copyto(out.reshape(-1, t, p * p), gathered)


def resized_sizes(
    images: Image.Image | Sequence[Image.Image],
    *,
    patch_size: int,
    merge_size: int,
    min_pixels: int,
    max_pixels: int,
    caller: str,
) -> tuple[list[Image.Image], list[tuple[int, int]]]:
    """The batch as a list, and each image's ``(height, width)`` after `smart_resize`: every
    image checked before any work, so a bad one fails the batch at once and the output can be
    allocated once instead of concatenated. Shared by both native paths."""
    batch = [images] if isinstance(images, Image.Image) else list(images)
    if not batch:
        raise ValueError(f"{caller} needs at least one image")
    factor = patch_size * merge_size
    sizes: list[tuple[int, int]] = []
    for index, image in enumerate(batch):
        if not isinstance(image, Image.Image):
            raise TypeError(f"image {index}: expected a PIL image, got {type(image).__name__}")
        width, height = image.size
        try:
            size = smart_resize(
                height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
            )
        except ImageSizeError as exc:
            raise ImageSizeError(str(exc), height=height, width=width, index=index) from None
        sizes.append(size)
    return batch, sizes


def patchify_uint8(
    images: Image.Image | Sequence[Image.Image],
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 16384,
    resample: int = Image.Resampling.BICUBIC,
) -> tuple[np.ndarray, np.ndarray]:
    """Resize and patchify images in uint8 exactly as transformers' Qwen2-VL PIL backend does.

    The result equals ``Qwen2VLImageProcessorPil(do_rescale=False, do_normalize=False)``'s
    ``pixel_values`` cast to uint8, bit for bit, and its ``image_grid_thw``; no float array is
    ever made. The defaults are the Qwen2-VL checkpoints' settings (`QWEN2_VL_PATCH_SETTINGS`);
    `patch_settings_from_processor` reads them from a loaded image processor.

    Args:
        images: One PIL image, or a sequence of them (patches concatenated in order, as the
            processor does for a batch). Any mode: converted to RGB as transformers does
            (transparency composited onto white).
        patch_size: Spatial patch side.
        temporal_patch_size: Frames per patch; an image is its one frame repeated.
        merge_size: Patches merged per side into one token.
        min_pixels: Smallest area after resizing.
        max_pixels: Largest area after resizing.
        resample: Pillow resampling filter (bicubic, 3, for Qwen2-VL).

    Returns:
        ``(pixel_values, image_grid_thw)``: uint8 ``(total_patches, 3 * T * P * P)``, contiguous;
        int64 ``(num_images, 3)`` rows ``(1, grid_h, grid_w)``.

    Raises:
        TypeError: an item is not a PIL image.
        ImageSizeError: an image is empty or beyond the 200:1 aspect-ratio limit (its
            ``index`` says which).
    """
    batch, sizes = resized_sizes(
        images,
        patch_size=patch_size,
        merge_size=merge_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        caller="patchify_uint8",
    )

    counts = [(h // patch_size) * (w // patch_size) for h, w in sizes]
    # Made where the core hands outputs back from (a worker process's shared block): not copied.
    pixel_values = output_tensor(
        (sum(counts), _CHANNELS * temporal_patch_size * patch_size * patch_size)
    ).numpy()
    grid_thw = np.array(
        [(1, h // patch_size, w // patch_size) for h, w in sizes], dtype=np.int64
    ).reshape(len(batch), 3)

    row = 0
    for image, (height, width), count in zip(batch, sizes, counts, strict=True):
        resized = to_rgb(image).resize((width, height), resample=resample)
        pixels, keep_alive = rgb_pixels(resized)
        _write_patches(
            pixels,
            pixel_values[row : row + count],
            patch_size=patch_size,
            temporal_patch_size=temporal_patch_size,
            merge_size=merge_size,
        )
        del pixels, keep_alive  # the view must not outlive the exported memory
        row += count
    return pixel_values, grid_thw
