"""The Qwen2-VL / Qwen2.5-VL model hooks.

Images and videos become flattened patches (``pixel_values``, rows ``C*T*P*P``) plus a
``(t, h, w)`` grid per item; each ``<|image_pad|>`` / ``<|video_pad|>`` in the prompt expands to
``prod(grid) / merge_size**2`` copies of itself. With device normalisation on and the PIL
backend, images take a native uint8 path (:mod:`mmproc_qwen_vl.image_fast_path`) that gives the
very pixels transformers would, without ever making floats; the torchvision backend on the CPU
has its own (:mod:`mmproc_qwen_vl.torch_fast_path`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from mmproc import hookimpl
from mmproc.context import ModelContext, ProcessingMode
from mmproc.fields import BatchedField, FieldSpec, FlatField
from mmproc.fused_norm import ChannelLayout, NormSpec
from mmproc.media import DEFAULT_VIDEO_FPS, MediaFormat, VideoSampling
from mmproc.prompt_update import PromptReplacement, PromptUpdate

from mmproc_qwen_vl.image_fast_path import (
    image_token_count,
    patch_settings_from_processor,
    patchify_uint8,
)
from mmproc_qwen_vl.loading import load_qwen_processor
from mmproc_qwen_vl.torch_fast_path import (
    is_torchvision_backend,
    patchify_uint8_torch,
    torch_patch_settings,
)

__all__ = ["QwenVLModel", "num_image_tokens"]

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


def _is_pil_backend(image_processor: Any) -> bool:
    from transformers.image_processing_backends import PilBackend

    return isinstance(image_processor, PilBackend)


def num_image_tokens(processor: Any, height: int, width: int) -> int:
    """Placeholder tokens an image of ``height`` x ``width`` expands to, without processing it.

    For engines' token budgeting; equal to what processing the image gives.
    """
    settings = patch_settings_from_processor(processor)
    return image_token_count(
        height,
        width,
        patch_size=settings["patch_size"],
        merge_size=settings["merge_size"],
        min_pixels=settings["min_pixels"],
        max_pixels=settings["max_pixels"],
    )


class QwenVLModel:
    """Hooks for ``Qwen2VLForConditionalGeneration`` and ``Qwen2_5_VLForConditionalGeneration``."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: ``"pil"`` or ``"torchvision"`` (default) image processor."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Assemble the processor from its parts (see :mod:`mmproc_qwen_vl.loading`)."""
        return load_qwen_processor(ctx)

    @hookimpl
    def process_mm_data(
        self,
        mode: ProcessingMode,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
    ) -> Mapping[str, Any] | None:
        """The uint8 fast paths for images alone, media only, raw pixels and no caller kwargs
        (PIL backend; torchvision on the CPU); None lets the HF processor run."""
        images = mm_items.get("image", ())
        if not (
            mode.media_only
            and mode.raw_pixels
            and not mode.user_kwargs
            and images
            and set(mm_items) == {"image"}
        ):
            return None
        image_processor = processor.image_processor
        if _is_pil_backend(image_processor):
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

    @hookimpl
    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """One ``<|vision_start|><|..._pad|><|vision_end|>`` per item."""
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0) + VIDEO_PLACEHOLDER * mm_counts.get(
            "video", 0
        )

    @hookimpl
    def get_mm_fields(
        self, ctx: ModelContext, outputs: Mapping[str, Any]
    ) -> Mapping[str, FieldSpec]:
        """Patches are flat, split by each item's grid product; grids are one row per item."""
        fields: dict[str, FieldSpec] = {
            "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
            "image_grid_thw": BatchedField("image"),
            "pixel_values_videos": FlatField.from_grid("video", "video_grid_thw"),
            "video_grid_thw": BatchedField("video"),
            "second_per_grid_ts": BatchedField("video"),  # Qwen2.5-VL
        }
        return {key: spec for key, spec in fields.items() if key in outputs}

    @hookimpl
    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """Each pad token becomes ``prod(grid) / merge_size**2`` pad tokens."""
        updates: list[PromptUpdate] = []
        for modality in ("image", "video"):
            outputs = item_outputs.get(modality)
            if not outputs:
                continue  # (a processor without video has no video attributes to read)
            token_id = getattr(processor, f"{modality}_token_id")
            merge = int(getattr(processor, f"{modality}_processor").merge_size) ** 2
            expand = _grid_expansion(outputs, f"{modality}_grid_thw", token_id, merge)
            updates.append(PromptReplacement(modality, [token_id], expand))
        return updates

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat | None:
        """Video files sampled as Qwen2-VL's video processor would: its fps (2 when it names
        none, as qwen-vl-utils does), its frame bounds, an even count (temporal patch 2)."""
        video = getattr(processor, "video_processor", None)
        if video is None:
            return None
        return MediaFormat(
            video=VideoSampling(
                fps=getattr(video, "fps", None) or DEFAULT_VIDEO_FPS,
                min_frames=int(getattr(video, "min_frames", None) or 1),
                max_frames=getattr(video, "max_frames", None),
                frame_multiple=int(video.temporal_patch_size),
            )
        )

    @hookimpl
    def device_norm_spec(self, ctx: ModelContext, processor: Any) -> NormSpec | None:
        """Pixels travel as uint8; the engine normalises with the image processor's settings."""
        image_processor = processor.image_processor
        layout = ChannelLayout.flat_patches(
            int(image_processor.patch_size), int(image_processor.temporal_patch_size)
        )
        video = getattr(processor, "video_processor", None)
        if video is not None and not _same_normalisation(image_processor, video):
            # The raw-pixel switches reach both processors, and one spec cannot undo two
            # different normalisations: such folders normalise on the CPU.
            return None
        keys = ["pixel_values"] if video is None else ["pixel_values", "pixel_values_videos"]
        return NormSpec.from_image_processor(image_processor, layout=layout, pixel_keys=keys)


def _grid_expansion(
    outputs: Sequence[Mapping[str, Any]], grid_key: str, token_id: int, merge: int
) -> Any:
    """The replacement of item ``index``: ``prod(grid) / merge`` copies of ``token_id``."""

    def expand(index: int) -> list[int]:
        return [token_id] * (int(torch.as_tensor(outputs[index][grid_key]).prod()) // merge)

    return expand


def _same_normalisation(a: Any, b: Any) -> bool:
    names = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
    return all(_as_tuple(getattr(a, n, None)) == _as_tuple(getattr(b, n, None)) for n in names)


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value
