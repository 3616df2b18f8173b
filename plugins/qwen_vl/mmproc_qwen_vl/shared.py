"""What plugins of models built on Qwen2-VL's image processing may use from this plugin.

Several model families process images as Qwen2-VL does (flattened patches and a ``(t, h, w)``
grid per item, a pad token repeated once per merged patch): Sarashina2-Vision and ERNIE-4.5-VL
among the plugins shipped with mmproc. Their plugins build on these functions, each a piece of a
hook they call from their own hook implementations (delegation: a plugin never inherits another
plugin's hooks), and nothing else of this plugin:

* loading: :func:`chosen_backend`, :func:`qwen2_vl_image_processor_class`;
* ``process_mm_data``: :func:`uint8_patches`, the native uint8 paths (bit-identical to
  transformers' raw pixels, without floats);
* ``get_mm_fields``: :func:`patch_fields`;
* ``get_prompt_updates``: :func:`repeated_token`, :func:`grid_prompt_updates`;
* ``device_norm_spec``: :func:`same_normalisation`, :func:`patch_norm_spec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from mmproc.plugin import (
    BatchedField,
    ChannelLayout,
    ConfigurationError,
    FieldSpec,
    FlatField,
    ModelContext,
    NormSpec,
    ProcessingMode,
    PromptReplacement,
    PromptUpdate,
)

from mmproc_qwen_vl.image_fast_path import patch_settings_from_processor, patchify_uint8
from mmproc_qwen_vl.torch_fast_path import (
    is_torchvision_backend,
    patchify_uint8_torch,
    torch_patch_settings,
)

__all__ = [
    "BACKENDS",
    "chosen_backend",
    "grid_prompt_updates",
    "is_pil_backend",
    "patch_fields",
    "patch_norm_spec",
    "qwen2_vl_image_processor_class",
    "repeated_token",
    "same_normalisation",
    "uint8_patches",
]

BACKENDS = ("torchvision", "pil")
"""The image backends of the ``backend`` option; the first is the default."""


def chosen_backend(ctx: ModelContext) -> str:
    """The image backend option ``backend`` names (default ``"torchvision"``), checked."""
    backend = ctx.option("backend") or BACKENDS[0]
    if backend not in BACKENDS:
        raise ConfigurationError(
            f"{ctx.architecture}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
        )
    return str(backend)


def qwen2_vl_image_processor_class(backend: str) -> type[Any]:
    """transformers' Qwen2-VL image processor class for ``backend`` (``"pil"`` or
    ``"torchvision"``)."""
    if backend == "pil":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        return Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor


def is_pil_backend(image_processor: Any) -> bool:
    """Whether ``image_processor`` is one of transformers' PIL-backend image processors."""
    from transformers.image_processing_backends import PilBackend

    return isinstance(image_processor, PilBackend)


def uint8_patches(
    mode: ProcessingMode, images: Sequence[Any], processor: Any
) -> Mapping[str, Any] | None:
    """``pixel_values`` (uint8 patches) and ``image_grid_thw`` for ``images`` through the native
    paths, identical to what transformers gives with rescale and normalise off; ``None`` when
    the call is not one they serve (text with the media, normalised pixels, caller keyword
    arguments, a fast processor off the CPU) or the processor's settings are ones they do not
    reproduce: then transformers runs.

    Raises:
        ValueError: an image transformers refuses too (a side of 0, an aspect ratio over 200:1).
    """
    if not (mode.media_only and mode.raw_pixels and not mode.user_kwargs and images):
        return None
    image_processor = processor.image_processor
    if is_pil_backend(image_processor):
        try:
            settings = patch_settings_from_processor(image_processor)
        except ValueError:
            return None  # settings the native path does not reproduce: transformers runs
        pixels, grids = patchify_uint8(list(images), **settings)
        return {
            "pixel_values": torch.from_numpy(pixels),
            "image_grid_thw": torch.from_numpy(grids).to(torch.long),
        }
    if mode.device_type == "cpu" and is_torchvision_backend(image_processor):
        try:
            torch_settings = torch_patch_settings(image_processor)
        except ValueError:
            return None
        pixel_values, image_grid_thw = patchify_uint8_torch(list(images), **torch_settings)
        return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    return None


def patch_fields(
    outputs: Mapping[str, Any], modalities: Sequence[str] = ("image", "video")
) -> dict[str, FieldSpec]:
    """Patches are flat, split by each item's grid product; grids are one row per item (and
    Qwen2.5-VL's ``second_per_grid_ts`` one value per video)."""
    fields: dict[str, FieldSpec] = {}
    if "image" in modalities:
        fields["pixel_values"] = FlatField.from_grid("image", "image_grid_thw")
        fields["image_grid_thw"] = BatchedField("image")
    if "video" in modalities:
        fields["pixel_values_videos"] = FlatField.from_grid("video", "video_grid_thw")
        fields["video_grid_thw"] = BatchedField("video")
        fields["second_per_grid_ts"] = BatchedField("video")
    return {key: spec for key, spec in fields.items() if key in outputs}


def repeated_token(
    outputs: Sequence[Mapping[str, Any]], grid_key: str, token_id: int, per_token: int
) -> Callable[[int], list[int]]:
    """The replacement of item ``index``: ``prod(grid) / per_token`` copies of ``token_id``."""

    def expand(index: int) -> list[int]:
        return [token_id] * (int(torch.as_tensor(outputs[index][grid_key]).prod()) // per_token)

    return expand


def grid_prompt_updates(
    processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[PromptUpdate]:
    """Each ``<|image_pad|>`` / ``<|video_pad|>`` becomes ``prod(grid) / merge_size**2`` copies
    of itself (the processor's token ids and merge sizes)."""
    updates: list[PromptUpdate] = []
    for modality in ("image", "video"):
        outputs = item_outputs.get(modality)
        if not outputs:
            continue  # (a processor without video has no video attributes to read)
        token_id = getattr(processor, f"{modality}_token_id")
        merge = int(getattr(processor, f"{modality}_processor").merge_size) ** 2
        expand = repeated_token(outputs, f"{modality}_grid_thw", token_id, merge)
        updates.append(PromptReplacement(modality, [token_id], expand))
    return updates


def same_normalisation(a: Any, b: Any) -> bool:
    """Whether two image or video processors rescale and normalise alike (one spec serves both)."""
    names = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
    return all(_as_tuple(getattr(a, n, None)) == _as_tuple(getattr(b, n, None)) for n in names)


def patch_norm_spec(processor: Any) -> NormSpec | None:
    """Pixels travel as uint8 and the engine normalises them with the image processor's
    settings, patches laid out as Qwen2-VL's; ``None`` when the video processor normalises
    otherwise (the raw-pixel switches reach both, and one spec cannot undo two)."""
    image_processor = processor.image_processor
    layout = ChannelLayout.flat_patches(
        int(image_processor.patch_size), int(image_processor.temporal_patch_size)
    )
    video = getattr(processor, "video_processor", None)
    if video is not None and not same_normalisation(image_processor, video):
        return None
    keys = ["pixel_values"] if video is None else ["pixel_values", "pixel_values_videos"]
    return NormSpec.from_image_processor(image_processor, layout=layout, pixel_keys=keys)


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value
