"""Qwen2-VL image patches in uint8, bit-identical to transformers' torchvision backend on the CPU.

The torchvision backend of transformers (``Qwen2VLImageProcessor``, 5.x) called with
``do_rescale=False, do_normalize=False`` (and ``device="cpu"``, as mmproc calls it) does, per
image:

1. convert to RGB (``TorchvisionBackend.process_image``): a PIL image goes through the same
   ``image_transforms.convert_to_rgb`` as the PIL backend (an alpha band or a ``transparency``
   key: ``convert("RGBA")`` and ``Image.alpha_composite`` onto opaque white; else
   ``convert("RGB")``), then ``np.array`` (H, W, 3) uint8, ``torch.from_numpy``,
   ``permute(2, 0, 1)`` and ``.contiguous()``: a channels-first uint8 tensor (``.to("cpu")`` is a
   no-op);
2. group the images by shape and stack each group into one (N, 3, H, W) batch;
3. resize each batch: ``smart_resize`` gives the size, then
   ``torchvision.transforms.v2.functional.resize(batch, [h, w], interpolation=mode,
   antialias=True)`` with ``mode = pil_torch_interpolation_mapping[resample]`` (bicubic for
   Qwen2-VL). On the CPU with a uint8 input torchvision resizes natively in uint8 where the CPU
   allows (rounding inside torch's kernel), else in float32 and rounds back (clamped for
   bicubic); an unchanged size returns the input itself;
4. ``rescale_and_normalize``: with both switches off nothing happens, so the tensor stays uint8;
5. patchify: reshape into merge windows of patches, ``permute(0, 2, 5, 3, 6, 1, 4, 7)``,
   ``unsqueeze`` + ``expand`` the one frame ``temporal_patch_size`` times, ``reshape`` (a copy) to
   (patches, C * T * P * P); batches are put back in input order and ``torch.cat``-ed.

``pixel_values`` therefore come out uint8 and ``image_grid_thw`` int64 rows ``(1, gh, gw)``.
Here step 1 is the same Pillow conversion, its pixels viewed in place as a channels-last
(C, H, W) tensor instead of copied three times into a channels-first one; step 3 is the same
torchvision call on it, image by image (the kernels resize each image of a batch on its own, so
stacking changes no value, and skipping it saves a copy; torch's uint8 kernel works on
channels-last pixels and converts channels-first input to them first, channel by channel, so
the values are the same, a fourth unused channel included); and step 5 is the same reordering
(a pure copy, no arithmetic) written straight into the output. Skipped: kwarg validation,
grouping, ``BatchFeature``, the final ``torch.cat``.

Only PIL images are taken, which is all mmproc hands the plugin (``mmproc.inputs`` makes arrays
and tensors ``L`` / ``RGB`` / ``RGBA`` images first). transformers given a 4-channel array itself
composites alpha in float32 (``TorchvisionBackend.convert_to_rgb``), which can differ from
Pillow's ``alpha_composite`` by 1-2 levels; that path is not reproduced here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from mmproc.plugin import output_tensor, rgbx_pixels
from PIL import Image

from mmproc_qwen_vl.image_fast_path import copy_patches, resized_sizes, to_rgb

if TYPE_CHECKING:
    from torchvision.transforms.v2.functional import InterpolationMode

# torchvision is imported where it is used: the plugin does not depend on it, and a processor
# on the torchvision backend (the only user of this module) implies it is installed.

__all__ = [
    "is_torchvision_backend",
    "patchify_uint8_torch",
    "rgb_planes",
    "torch_patch_settings",
]

_CHANNELS = 3

# The interpolation modes torchvision resizes tensors with (InterpolationMode values).
_RESIZE_MODES = frozenset({"nearest", "nearest-exact", "bilinear", "bicubic", "lanczos"})


def is_torchvision_backend(image_processor: Any) -> bool:
    """Whether ``image_processor`` is a transformers torchvision-backend image processor."""
    from transformers.image_processing_backends import TorchvisionBackend

    return isinstance(image_processor, TorchvisionBackend)


def _interpolation(resample: Any) -> InterpolationMode:
    """The torchvision mode ``TorchvisionBackend.resize`` turns ``resample`` into.

    Raises:
        ValueError: a mode transformers cannot map or resize with, or one it would swap for
            another (LANCZOS on torchvision < 0.27); the fast path does not guess.
    """
    from torchvision.transforms.v2 import functional as tvF
    from transformers.image_utils import PILImageResampling, pil_torch_interpolation_mapping
    from transformers.utils.import_utils import is_torchvision_greater_or_equal

    if resample is None:
        return tvF.InterpolationMode.BILINEAR  # transformers' choice when unset
    if isinstance(resample, tvF.InterpolationMode):
        mode = resample
    else:
        try:
            mode = pil_torch_interpolation_mapping[PILImageResampling(int(resample))]
        except (TypeError, ValueError, KeyError):
            raise ValueError(f"resample {resample!r} has no torchvision interpolation") from None
    if mode.value not in _RESIZE_MODES:
        # BOX / HAMMING: torch has no such resize kernel and transformers fails on them; it can
        # raise its own error.
        raise ValueError(f"torchvision cannot resize tensors with {mode.value!r}")
    if mode == tvF.InterpolationMode.LANCZOS and not is_torchvision_greater_or_equal("0.27"):
        # transformers falls back to BICUBIC with a warning there; let it do so itself.
        raise ValueError("LANCZOS needs torchvision >= 0.27 for the fast path")
    return mode


def torch_patch_settings(image_processor: Any) -> dict[str, Any]:
    """The `patchify_uint8_torch` keyword arguments that reproduce ``image_processor``.

    Accepts a Qwen2-VL torchvision image processor or a full processor holding one (anything with
    the same attributes).

    Raises:
        ValueError: the processor does not resize, does not convert to RGB, or its resample
            setting is not one the fast path reproduces.
    """
    ip = image_processor
    if not hasattr(ip, "patch_size") and hasattr(ip, "image_processor"):
        ip = ip.image_processor
    if getattr(ip, "do_resize", True) is False:
        raise ValueError("the uint8 fast path needs an image processor with do_resize=True")
    if getattr(ip, "do_convert_rgb", True) is False:
        # Without conversion the tensor keeps the PIL mode's channels (1, 2, 4...).
        raise ValueError("the uint8 fast path needs an image processor with do_convert_rgb=True")
    size = ip.size
    min_pixels, max_pixels = size["shortest_edge"], size["longest_edge"]
    if not min_pixels or not max_pixels:
        raise ValueError(f"size needs shortest_edge and longest_edge, got {size!r}")
    return {
        "patch_size": int(ip.patch_size),
        "temporal_patch_size": int(ip.temporal_patch_size),
        "merge_size": int(ip.merge_size),
        "min_pixels": int(min_pixels),
        "max_pixels": int(max_pixels),
        "interpolation": _interpolation(ip.resample),
    }


def rgb_planes(image: Image.Image) -> tuple[torch.Tensor, object]:
    """``image`` in RGB as a (C, H, W) uint8 tensor over Pillow's own memory, and what must stay
    alive while it is read.

    Same Pillow conversion as transformers. The tensor is channels-last in memory (Pillow's
    layout), with a fourth, unused channel where Pillow keeps four bytes a pixel: torch's uint8
    antialiased resize works on channels-last pixels, three or four to a pixel, and converts a
    channels-first tensor (transformers' ``.contiguous()``) back to that first; each channel is
    resized on its own, so the first three come out as transformers' three.
    """
    pixels, keep_alive = rgbx_pixels(to_rgb(image))
    return torch.from_numpy(pixels).permute(2, 0, 1), (pixels, keep_alive)


def _write_patches(
    image: torch.Tensor,
    out: torch.Tensor,
    *,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
) -> None:
    """Write a resized (C, H, W) uint8 image (its first 3 channels) into ``out`` (patches,
    3*T*P*P) in transformers' order.

    Rows: merge windows row-major, then the patches of a window row-major; within a row: channel,
    frame (the one image repeated), patch row, patch column.
    """
    _, height, width = image.shape
    p, m, t = patch_size, merge_size, temporal_patch_size
    grid_h, grid_w = height // p, width // p
    # numpy views of the same memory: a pure copy either way, but numpy's strided gather of
    # these short runs is faster than torch's. The pixels as (H, W, C), a view when the resize
    # kept them channels-last (numpy copies in reshape otherwise).
    src, dst = image.permute(1, 2, 0).numpy()[..., :_CHANNELS], out.numpy()
    # (window row, row in window, y, window col, col in window, x, C) ->
    # (window row, window col, row in window, col in window, C, y, x): transformers' permute
    # without the batch dimension.
    ordered = src.reshape(grid_h // m, m, p, grid_w // m, m, p, _CHANNELS).transpose(
        0, 3, 1, 4, 6, 2, 5
    )
    copy_patches(ordered, dst, temporal_patch_size=t, patch_size=p)


def patchify_uint8_torch(
    images: Image.Image | Sequence[Image.Image],
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 16384,
    interpolation: InterpolationMode | str = "bicubic",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize and patchify images exactly as transformers' Qwen2-VL torchvision backend on the CPU.

    The result equals ``Qwen2VLImageProcessor(...)(images, do_rescale=False,
    do_normalize=False)``'s ``pixel_values`` (uint8) and ``image_grid_thw`` (int64), bit for bit;
    no float tensor is made beyond what torchvision's resize itself does.

    Args:
        images: One PIL image or a sequence of them (patches concatenated in order). Any mode:
            converted to RGB as transformers does (transparency composited onto white).
        patch_size: Spatial patch side.
        temporal_patch_size: Frames per patch; an image is its one frame repeated.
        merge_size: Patches merged per side into one token.
        min_pixels: Smallest area after resizing.
        max_pixels: Largest area after resizing.
        interpolation: torchvision interpolation mode or its value (``"bicubic"``);
            `torch_patch_settings` maps the processor's ``resample`` as transformers does.
            Antialiasing is on, as there.

    Returns:
        ``(pixel_values, image_grid_thw)``: uint8 ``(total_patches, 3 * T * P * P)``,
        contiguous; int64 ``(num_images, 3)`` rows ``(1, grid_h, grid_w)``.

    Raises:
        TypeError: an item is not a PIL image.
        ImageSizeError: an image is empty or beyond the 200:1 aspect-ratio limit (its ``index``
            says which).
    """
    from torchvision.transforms.v2 import functional as tvF

    interpolation = tvF.InterpolationMode(interpolation)
    batch, sizes = resized_sizes(
        images,
        patch_size=patch_size,
        merge_size=merge_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        caller="patchify_uint8_torch",
    )

    grids = [(1, h // patch_size, w // patch_size) for h, w in sizes]
    counts = [gh * gw for _, gh, gw in grids]
    # Made where the core hands outputs back from (a worker process's shared block): not copied.
    pixel_values = output_tensor(
        (sum(counts), _CHANNELS * temporal_patch_size * patch_size * patch_size), torch.uint8
    )
    image_grid_thw = torch.tensor(grids, dtype=torch.long).reshape(len(batch), 3)

    row = 0
    for image, (height, width), count in zip(batch, sizes, counts, strict=True):
        planes, keep_alive = rgb_planes(image)
        resized = tvF.resize(planes, [height, width], interpolation=interpolation, antialias=True)
        _write_patches(
            resized,
            pixel_values[row : row + count],
            patch_size=patch_size,
            temporal_patch_size=temporal_patch_size,
            merge_size=merge_size,
        )
        del planes, resized, keep_alive  # (an unchanged size resizes to the input itself)
        row += count
    return pixel_values, image_grid_thw
