"""The Qwen2-VL / Qwen2.5-VL model hooks.

Images and videos become flattened patches (``pixel_values``, rows ``C*T*P*P``) plus a
``(t, h, w)`` grid per item; each ``<|image_pad|>`` / ``<|video_pad|>`` in the prompt expands to
``prod(grid) / merge_size**2`` copies of itself. With device normalisation on, images take a
native uint8 path that gives the very pixels transformers would, without ever making floats
(:mod:`mmproc_qwen_vl.image_fast_path` for the PIL backend, :mod:`mmproc_qwen_vl.torch_fast_path`
for torchvision on the CPU). The pieces other plugins of Qwen2-VL-style models use are in
:mod:`mmproc_qwen_vl.shared`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mmproc.plugin import (
    DEFAULT_VIDEO_FPS,
    FieldSpec,
    MediaFormat,
    ModelContext,
    NormSpec,
    ProcessingMode,
    PromptUpdate,
    VideoSampling,
    hookimpl,
)

from mmproc_qwen_vl.image_fast_path import image_token_count, patch_settings_from_processor
from mmproc_qwen_vl.loading import load_qwen_processor
from mmproc_qwen_vl.shared import grid_prompt_updates, patch_fields, patch_norm_spec, uint8_patches

__all__ = ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "QwenVLModel", "num_image_tokens"]

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


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
        """The native uint8 paths for images alone; None lets the HF processor run."""
        if set(mm_items) != {"image"}:
            return None
        return uint8_patches(mode, mm_items["image"], processor)

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
        return patch_fields(outputs)

    @hookimpl
    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """Each pad token becomes ``prod(grid) / merge_size**2`` pad tokens."""
        return grid_prompt_updates(processor, item_outputs)

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
        return patch_norm_spec(processor)
