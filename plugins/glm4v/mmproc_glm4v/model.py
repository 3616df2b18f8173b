"""The GLM-4.1V / GLM-4.5V / GLM-4.6V model hooks.

Images and videos become Qwen2-VL-style flattened patches with a ``(t, h, w)`` grid per item
(patch 14, merge 2, frames in pairs). In the prompt, ``<|begin_of_image|><|image|>
<|end_of_image|>`` holds an image: its ``<|image|>`` becomes ``prod(grid) / 4`` copies;
``<|begin_of_video|><|video|><|end_of_video|>`` holds a video: its ``<|video|>`` becomes, per
frame pair, ``<|begin_of_image|>``, the pair's ``<|image|>`` tokens, ``<|end_of_image|>`` and
the pair's timestamp as text (``Glm4vProcessor``: whole seconds; ``Glm46VProcessor``:
``x.y seconds``). A video's embeddings land on ``<|image|>`` tokens too: only the per-token
``mm_token_type_ids`` (1 image, 2 video) tell them apart, and the model needs them
(:meth:`Glm4vModel.get_prompt_outputs`).

The timestamps come from the video's metadata (the frames' source indices and rate): from the
file mmproc decoded, or given with the frames (:class:`mmproc.plugin.VideoItem`). A video
without any is refused, where transformers would assume 24 fps. Every hook that reads a
processor reads the one it is given; the text is the processor's own (its
``replace_video_token``), tokenised as the tokenizer splits it within a prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from mmproc.plugin import (
    FieldSpec,
    MediaFormat,
    ModelContext,
    NormSpec,
    PlaceholderRange,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    VideoSampling,
    hookimpl,
)
from mmproc_qwen_vl.shared import patch_fields, patch_norm_spec, repeated_token

from mmproc_glm4v.loading import load_glm_processor

__all__ = ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "Glm4vModel", "video_token_ids"]

IMAGE_PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO_PLACEHOLDER = "<|begin_of_video|><|video|><|end_of_video|>"


def video_token_ids(processor: Any, grid: Any, metadata: Any) -> list[int]:
    """The token ids a video of ``grid`` (its ``video_grid_thw``) with ``metadata`` (mmproc's
    :class:`~mmproc.plugin.VideoMetadata`) expands to: the processor's own text for it."""
    inputs = {"video_grid_thw": [grid], "video_metadata": [metadata.to_transformers()]}
    text = processor.replace_video_token(inputs, 0)
    return list(processor.tokenizer.encode(text, add_special_tokens=False))


class Glm4vModel:
    """Hooks for ``Glm4vForConditionalGeneration``, ``Glm4vMoeForConditionalGeneration`` and
    ``Glm46VForConditionalGeneration``."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: ``"torchvision"`` (default) or ``"pil"`` image processor."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """The processor the folder names (see :mod:`mmproc_glm4v.loading`)."""
        return load_glm_processor(ctx)

    @hookimpl
    def process_mm_data(
        self, mm_items: Mapping[str, Sequence[Any]], processor: Any
    ) -> Mapping[str, Any] | None:
        """The processor as it is (``None``: the core calls ``processor``, the worker's clone),
        once every video has its metadata."""
        for video in mm_items.get("video", ()):
            if video.metadata is None:
                # transformers would assume 24 fps and write timestamps nobody gave. (A plain
                # exception: the core names the request's item it comes from.)
                raise ValueError(
                    "the video has no metadata, and GLM's prompt gives each frame pair its "
                    "timestamp: send the video file, or its frames as "
                    "mmproc.plugin.VideoItem(frames, VideoMetadata(...)) with their source "
                    "indices and frame rate"
                )
        return None

    @hookimpl
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """One image block per image, then one video block per video."""
        blocks = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}
        return "".join(text * mm_counts.get(modality, 0) for modality, text in blocks.items())

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """Patches are flat, split by each item's grid product; grids one row per item."""
        return patch_fields(outputs)

    @hookimpl
    def get_prompt_updates(
        self,
        processor: Any,
        mm_items: Mapping[str, Sequence[Any]],
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """``<|image|>`` becomes its image's tokens; ``<|video|>`` its video's frame pairs,
        each with its timestamp."""
        image_id = processor.image_token_id
        updates: list[PromptUpdate] = []
        images = item_outputs.get("image", [])
        if images:
            merge = int(processor.image_processor.merge_size) ** 2
            expand = repeated_token(images, "image_grid_thw", image_id, merge)
            updates.append(PromptReplacement("image", [image_id], expand))
        videos = item_outputs.get("video", [])
        if videos:
            items = mm_items["video"]

            def frames(index: int) -> PromptUpdateDetails:
                grid = videos[index]["video_grid_thw"]
                ids = video_token_ids(processor, grid, items[index].metadata)
                return PromptUpdateDetails.select_token_id(ids, image_id)

            updates.append(PromptReplacement("video", [processor.video_token_id], frames))
        return updates

    @hookimpl
    def get_prompt_outputs(
        self,
        processor: Any,
        prompt_token_ids: Sequence[int],
        placeholders: Mapping[str, Sequence[PlaceholderRange]],
    ) -> Mapping[str, Any]:
        """``mm_token_type_ids``, as the processor computes them from the ids: 2 for the
        ``<|image|>`` tokens between a video's start and end tokens, 1 for the others."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        in_video = np.cumsum(ids == processor.video_start_id) > np.cumsum(
            ids == processor.video_end_id
        )
        image = ids == processor.image_token_id
        types = np.zeros(len(ids), dtype=np.int64)
        types[image & in_video] = 2
        types[image & ~in_video] = 1
        return {"mm_token_type_ids": types}

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat:
        """Video files sampled at the video processor's rate (2 fps), at least two frames (it
        refuses one) and at most its ``max_duration`` of them; an odd count stays odd: the
        processor pads it with its last frame, as its own sampling does."""
        video = processor.video_processor
        fps = float(video.fps)
        sampling = VideoSampling(fps=fps, min_frames=2, max_frames=int(video.max_duration * fps))
        return MediaFormat(video=sampling)

    @hookimpl
    def device_norm_spec(self, processor: Any) -> NormSpec | None:
        """Patches travel as uint8 and the engine normalises them (Qwen2-VL's layout); ``None``
        when the video processor normalises otherwise."""
        return patch_norm_spec(processor)
