"""The Qwen2-VL / Qwen2.5-VL and Qwen3-VL / Qwen3.5 model hooks.

Images and videos become flattened patches (``pixel_values``, rows ``C*T*P*P``) plus a
``(t, h, w)`` grid per item; each ``<|image_pad|>`` / ``<|video_pad|>`` in the prompt expands to
``prod(grid) / merge_size**2`` copies of itself. Qwen3-VL and Qwen3.5 (:class:`Qwen3VLModel`)
expand a video's pad into one ``<t seconds><|vision_start|>`` pads ``<|vision_end|>`` block per
temporal patch, ``t`` from the video's metadata (:mod:`mmproc_qwen_vl.timestamps`). Every family
returns the prompt's ``mm_token_type_ids`` (1 on image pads, 2 on video pads), which the models
read for their multimodal positions. With device normalisation on, images take a
native uint8 path that gives the very pixels transformers would, without ever making floats
(:mod:`mmproc_qwen_vl.image_fast_path` for the PIL backend, :mod:`mmproc_qwen_vl.torch_fast_path`
for torchvision on the CPU). The pieces other plugins of Qwen2-VL-style models use are in
:mod:`mmproc_qwen_vl.shared`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from mmproc.plugin import (
    DEFAULT_VIDEO_FPS,
    FieldSpec,
    MediaFormat,
    ModelContext,
    NormSpec,
    PlaceholderRange,
    ProcessingMode,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    VideoItem,
    VideoSampling,
    hookimpl,
)

from mmproc_qwen_vl.image_fast_path import image_token_count, patch_settings_from_processor
from mmproc_qwen_vl.loading import load_qwen_processor
from mmproc_qwen_vl.shared import grid_prompt_updates, patch_fields, patch_norm_spec, uint8_patches
from mmproc_qwen_vl.timestamps import (
    pair_times,
    source_frames,
    timestamp_text,
    video_call_kwargs,
)

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "Qwen3VLModel",
    "QwenHooks",
    "QwenVLModel",
    "mm_token_type_ids",
    "num_image_tokens",
    "video_tokens",
]

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


def mm_token_type_ids(processor: Any, prompt_token_ids: Sequence[int]) -> np.ndarray:
    """The prompt's per-token modality, as the processor computes it: 1 on image pads, 2 on
    video pads, 0 elsewhere (timestamps and vision start / end tokens included)."""
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    types = np.zeros(len(ids), dtype=np.int64)
    types[ids == int(processor.image_token_id)] = 1
    types[ids == int(processor.video_token_id)] = 2
    return types


class QwenHooks:
    """The hooks every Qwen family of this plugin shares: options, loading, placeholders,
    fields, ``mm_token_type_ids``, video sampling, device normalisation (each family's class adds
    ``process_mm_data`` and ``get_prompt_updates``)."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: ``"pil"`` or ``"torchvision"`` (default) image processor."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Assemble the processor from its parts (see :mod:`mmproc_qwen_vl.loading`)."""
        return load_qwen_processor(ctx)

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
    def get_prompt_outputs(
        self,
        processor: Any,
        prompt_token_ids: Sequence[int],
        placeholders: Mapping[str, Sequence[PlaceholderRange]],
    ) -> Mapping[str, Any]:
        """``mm_token_type_ids`` of the final prompt (see :func:`mm_token_type_ids`)."""
        return {"mm_token_type_ids": mm_token_type_ids(processor, prompt_token_ids)}

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat | None:
        """Video files sampled as the model's video processor would: its fps (2 when it names
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


class QwenVLModel(QwenHooks):
    """Hooks for ``Qwen2VLForConditionalGeneration`` and ``Qwen2_5_VLForConditionalGeneration``."""

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
    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """Each pad token becomes ``prod(grid) / merge_size**2`` pad tokens."""
        return grid_prompt_updates(processor, item_outputs)


def video_tokens(processor: Any, video: VideoItem, grid: Any, index: int = 0) -> list[int]:
    """The token ids a Qwen3-VL video's ``<|video_pad|>`` becomes, as ``Qwen3VLProcessor``
    writes them: per temporal patch, its time (``<0.2 seconds>``, tokenised on its own: special
    tokens bound it on both sides), ``<|vision_start|>``, ``h * w / merge_size**2`` pads and
    ``<|vision_end|>``.

    Raises:
        ValueError: the video's metadata has no usable fps (``index`` names it).
    """
    video_processor = processor.video_processor
    grid_t, grid_h, grid_w = (int(n) for n in torch.as_tensor(grid).tolist())
    per_frame = grid_h * grid_w // int(video_processor.merge_size) ** 2
    times = pair_times(
        source_frames(video, video_processor, index), int(video_processor.temporal_patch_size)
    )
    if len(times) != grid_t:
        raise ValueError(
            f"video {index}: its metadata gives {len(times)} temporal patches, its grid {grid_t}"
        )
    tokenizer = processor.tokenizer
    frame = [
        int(processor.vision_start_token_id),
        *[int(processor.video_token_id)] * per_frame,
        int(processor.vision_end_token_id),
    ]
    tokens: list[int] = []
    for seconds in times:
        tokens += tokenizer.encode(timestamp_text(seconds), add_special_tokens=False)
        tokens += frame
    return tokens


class Qwen3VLModel(QwenHooks):
    """Hooks for ``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``,
    ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``: Qwen2-VL's
    images (patch 16), videos with their timestamps.

    Videos are always given to transformers with their metadata and ``do_sample_frames=False``
    (:func:`mmproc_qwen_vl.timestamps.video_call_kwargs`): a file's sampled frames, a caller's
    frames as given, and for frames without metadata the documented default of
    :func:`mmproc_qwen_vl.timestamps.default_source` (the model's 2 fps), never transformers'
    assumed 24 fps.
    """

    @hookimpl
    def process_mm_data(
        self,
        mode: ProcessingMode,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Mapping[str, Any] | None:
        """Images alone on the native uint8 paths when the mode allows; videos with their
        metadata, their frames kept as given; None (the default) for the rest."""
        images = list(mm_items.get("image", ()))
        videos = list(mm_items.get("video", ()))
        if not videos:
            return uint8_patches(mode, images, processor) if images else None
        kwargs: dict[str, Any] = {"return_tensors": "pt"}
        if not mode.media_only:
            kwargs["text"] = [prompt]
        if images:
            kwargs["images"] = images
        video_kwargs = video_call_kwargs(videos, processor.video_processor, hf_kwargs)
        return processor(**{**kwargs, **hf_kwargs, **video_kwargs})

    @hookimpl
    def get_prompt_updates(
        self,
        processor: Any,
        mm_items: Mapping[str, Sequence[Any]],
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """Each ``<|image_pad|>`` becomes ``prod(grid) / merge_size**2`` pads; each
        ``<|video_pad|>``, together with the ``<|vision_start|>`` and ``<|vision_end|>`` around
        it when it has them, becomes its timestamped blocks (:func:`video_tokens`), of which only
        the pads receive the video's embeddings.

        Every block has a start and an end of its own, so ``Qwen3VLProcessor`` (transformers 5.25
        on) drops the pair the chat template puts around the whole video; a pad written without
        them is replaced alone. Of the two replacements below an item takes the earlier match,
        which for a wrapped pad is the wrapper (it starts one token sooner)."""
        updates = grid_prompt_updates(processor, {"image": item_outputs.get("image", [])})
        videos, outputs = mm_items.get("video", []), item_outputs.get("video", [])
        if outputs:
            pad = int(processor.video_token_id)
            wrapped = [
                int(processor.vision_start_token_id),
                pad,
                int(processor.vision_end_token_id),
            ]

            @functools.cache
            def expand(index: int) -> PromptUpdateDetails:
                grid = outputs[index]["video_grid_thw"]
                tokens = video_tokens(processor, videos[index], grid, index)
                return PromptUpdateDetails.select_token_id(tokens, pad)

            updates.append(PromptReplacement("video", wrapped, expand))
            updates.append(PromptReplacement("video", [pad], expand))
        return updates
