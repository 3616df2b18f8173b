"""The ERNIE-4.5-VL model hooks, for both folder layouts (:mod:`mmproc_ernie45_vl.layout`).

Both layouts cut images and video frames into the same patch rows (``3 * 14 * 14 = 588`` values,
channel-major, one frame per row) with a ``(t, h, w)`` grid per item, and expand each item's
placeholder by its grid: ``h * w / 4`` tokens per image, ``t * h * w / 8`` per video (frames go
in pairs). They differ in the prompt and in who builds the processor:

* **converted** (transformers' ``Ernie4_5_VLMoeProcessor``): ``<|IMAGE_PLACEHOLDER|>`` and
  ``<|VIDEO_PLACEHOLDER|>`` between their start and end tokens expand to copies of themselves;
  the prompt's per-token ``mm_token_type_ids`` and ``moe_mm_token_type_ids`` come from
  :meth:`Ernie45VLModel.get_prompt_outputs`, as the processor computes them;
* **original** (Baidu's processor, reimplemented in :mod:`mmproc_ernie45_vl.original`): the whole
  ``<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>`` marker (video: the ``VIDEO_`` and
  ``video@placeholder`` form) becomes start, ``<|IMAGE_PLACEHOLDER|>`` x N, end, for videos
  too; Baidu's ``token_type_ids`` come from the items' placeholder ranges, because image and video
  tokens share one id.

Every hook that calls a processor calls the one it is given: the worker thread's own clone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from mmproc.plugin import (
    BatchedField,
    ChannelLayout,
    FieldSpec,
    FlatField,
    MediaFormat,
    ModelContext,
    NormSpec,
    PlaceholderRange,
    ProcessingMode,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    VideoSampling,
    hf_video_kwargs,
    hookimpl,
)
from mmproc_qwen_vl.shared import repeated_token, same_normalisation, uint8_patches

from mmproc_ernie45_vl.layout import Layout, detect_layout
from mmproc_ernie45_vl.loading import load_ernie_processor
from mmproc_ernie45_vl.original import IMAGE_MARKER, VIDEO_MARKER

__all__ = [
    "CONVERTED_IMAGE_PLACEHOLDER",
    "CONVERTED_VIDEO_PLACEHOLDER",
    "ERNIE_VIDEO_FPS",
    "Ernie45VLModel",
]

CONVERTED_IMAGE_PLACEHOLDER = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
CONVERTED_VIDEO_PLACEHOLDER = "<|VIDEO_START|><|VIDEO_PLACEHOLDER|><|VIDEO_END|>"
#: The rate ERNIE-4.5-VL's videos are sampled at (the original processor's ``video_fps``); the
#: converted video processor names none.
ERNIE_VIDEO_FPS = 2.0

_PIXEL_KEYS = ("pixel_values", "pixel_values_videos")


def _layout(ctx: ModelContext) -> Layout:
    return detect_layout(ctx.config)


class Ernie45VLModel:
    """Hooks for ``Ernie4_5_VLMoeForConditionalGeneration``, original and converted folders."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: the converted layout's image backend, ``"torchvision"`` (default) or
        ``"pil"``; an original folder resizes with Pillow only."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """The layout's processor (see :mod:`mmproc_ernie45_vl.loading`)."""
        return load_ernie_processor(ctx)

    @hookimpl
    def process_mm_data(
        self,
        ctx: ModelContext,
        mode: ProcessingMode,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        """The given processor on the prompt and items; converted-layout images alone on the
        Qwen family's native uint8 paths when the mode allows."""
        images = list(mm_items.get("image", ()))
        videos = list(mm_items.get("video", ()))
        kwargs: dict[str, Any] = {"text": [prompt], "return_tensors": "pt"}
        if images:
            kwargs["images"] = images
        if _layout(ctx) is Layout.ORIGINAL:
            if videos:
                kwargs["videos"] = [video.frames for video in videos]
                kwargs["video_metadata"] = [video.metadata for video in videos]
            return processor(**{**kwargs, **hf_kwargs})
        if images and not videos:
            # ERNIE's image patches are Qwen2-VL's with a temporal patch of 1.
            try:
                fast = uint8_patches(mode, images, processor)
            except ValueError:
                fast = None  # an image transformers refuses too: it runs and says so itself
            if fast is not None:
                return fast
        if videos:
            kwargs.update(hf_video_kwargs(videos))
            if "do_sample_frames" not in kwargs and _sampling_keeps_every_frame(
                processor.video_processor, videos, hf_kwargs
            ):
                # The same frames, without transformers' sampling step, which fails on a
                # one-frame array (numpy reads the one-element index tensor as a scalar).
                kwargs["do_sample_frames"] = False
        outputs = processor(**{**kwargs, **hf_kwargs})
        # A per-token output of the prompt, not of an item: get_prompt_outputs gives it.
        outputs.pop("moe_mm_token_type_ids", None)
        return outputs

    @hookimpl
    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """One start-placeholder-end marker per item, images first."""
        if _layout(ctx) is Layout.ORIGINAL:
            image, video = IMAGE_MARKER, VIDEO_MARKER
        else:
            image, video = CONVERTED_IMAGE_PLACEHOLDER, CONVERTED_VIDEO_PLACEHOLDER
        return image * mm_counts.get("image", 0) + video * mm_counts.get("video", 0)

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """Patch rows are flat, split by each item's grid product; grids one row per item."""
        fields: dict[str, FieldSpec] = {
            "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
            "image_grid_thw": BatchedField("image"),
            "pixel_values_videos": FlatField.from_grid("video", "video_grid_thw"),
            "video_grid_thw": BatchedField("video"),
        }
        return {key: spec for key, spec in fields.items() if key in outputs}

    @hookimpl
    def get_prompt_updates(
        self,
        ctx: ModelContext,
        processor: Any,
        item_outputs: Mapping[str, Sequence[Mapping[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """Converted: each placeholder token becomes its item's token count of itself.
        Original: each whole marker becomes start, ``<|IMAGE_PLACEHOLDER|>`` x count, end."""
        images = item_outputs.get("image", [])
        videos = item_outputs.get("video", [])
        updates: list[PromptUpdate] = []
        if _layout(ctx) is Layout.ORIGINAL:
            patch = processor.im_patch_id
            for modality, outputs, marker, count in (
                ("image", images, processor.image_marker_ids, processor.image_token_count),
                ("video", videos, processor.video_marker_ids, processor.video_token_count),
            ):
                if outputs:
                    wrap = _wrapped(outputs, f"{modality}_grid_thw", marker, patch, count)
                    updates.append(PromptReplacement(modality, list(marker), wrap))
            return updates
        if images:
            merge = int(processor.image_processor.merge_size) ** 2
            token = processor.image_token_id
            updates.append(
                PromptReplacement(
                    "image", [token], repeated_token(images, "image_grid_thw", token, merge)
                )
            )
        if videos:
            video_processor = processor.video_processor
            per_token = int(video_processor.merge_size) ** 2 * int(
                video_processor.temporal_patch_size
            )
            token = processor.video_token_id
            updates.append(
                PromptReplacement(
                    "video", [token], repeated_token(videos, "video_grid_thw", token, per_token)
                )
            )
        return updates

    @hookimpl
    def get_prompt_outputs(
        self,
        ctx: ModelContext,
        processor: Any,
        prompt_token_ids: Sequence[int],
        placeholders: Mapping[str, Sequence[PlaceholderRange]],
    ) -> Mapping[str, Any]:
        """Converted: ``mm_token_type_ids`` (1 image, 2 video placeholder tokens) and
        ``moe_mm_token_type_ids`` (also 1 / 2 on the image / video start and end tokens), from
        the ids as the processor computes them. Original: Baidu's ``token_type_ids`` (1 on an
        image's whole range and on a video's start and end tokens, 2 on a video's placeholder
        tokens), from the ranges: image and video tokens share one id."""
        if _layout(ctx) is Layout.ORIGINAL:
            types = np.zeros(len(prompt_token_ids), dtype=np.int64)
            for r in placeholders.get("image", ()):
                types[r.offset : r.end] = 1
            for r in placeholders.get("video", ()):
                types[r.offset : r.end] = np.where(np.array(r.embed_mask(), dtype=bool), 2, 1)
            return {"token_type_ids": types}
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        mm_types = np.zeros(len(ids), dtype=np.int64)
        mm_types[ids == processor.image_token_id] = 1
        mm_types[ids == processor.video_token_id] = 2
        moe_types = mm_types.copy()
        moe_types[np.isin(ids, [processor.image_start_token_id, processor.image_end_token_id])] = 1
        moe_types[np.isin(ids, [processor.video_start_token_id, processor.video_end_token_id])] = 2
        return {"mm_token_type_ids": mm_types, "moe_mm_token_type_ids": moe_types}

    @hookimpl
    def media_format(self, ctx: ModelContext, processor: Any) -> MediaFormat:
        """Video files sampled as ERNIE-4.5-VL's processor samples them: 2 fps (the original
        processor's ``video_fps``), at least 16 and at most 180 frames; an odd count is left
        odd, for the processor pads it with a copy of its last stamped frame."""
        if _layout(ctx) is Layout.ORIGINAL:
            fps = processor.video_fps
            low, high = processor.video_min_frames, processor.video_max_frames
        else:
            video = processor.video_processor
            fps = getattr(video, "fps", None) or ERNIE_VIDEO_FPS
            low, high = int(video.min_frames), int(video.max_frames)
        return MediaFormat(
            video=VideoSampling(fps=fps, min_frames=low, max_frames=high, frame_multiple=1)
        )

    @hookimpl
    def device_norm_spec(self, ctx: ModelContext, processor: Any) -> NormSpec | None:
        """Pixels travel as uint8 patch rows; the engine rescales and normalises them with the
        folder's settings (one frame of ``patch_size**2`` values per channel in a row)."""
        image_processor = processor.image_processor
        layout = ChannelLayout.flat_patches(int(image_processor.patch_size), 1)
        if _layout(ctx) is Layout.CONVERTED and not same_normalisation(
            image_processor, processor.video_processor
        ):
            # The raw-pixel switches reach both processors, and one spec cannot undo two
            # different normalisations: such folders normalise on the CPU.
            return None
        return NormSpec.from_image_processor(image_processor, layout=layout, pixel_keys=_PIXEL_KEYS)


# Call keywords that change which frames transformers' video sampling takes.
_SAMPLING_KWARGS = frozenset({"do_sample_frames", "num_frames", "fps", "min_frames", "max_frames"})


def _sampling_keeps_every_frame(
    video_processor: Any, videos: Sequence[Any], hf_kwargs: Mapping[str, Any]
) -> bool:
    """Whether transformers' frame sampling would take every frame of ``videos`` (frames given
    without metadata): no rate or count set, and none longer than ``max_frames``."""
    if _SAMPLING_KWARGS & set(hf_kwargs):
        return False
    if getattr(video_processor, "fps", None) is not None:
        return False
    if getattr(video_processor, "num_frames", None) is not None:
        return False
    return all(video.num_frames <= int(video_processor.max_frames) for video in videos)


def _wrapped(
    outputs: Sequence[Mapping[str, Any]],
    grid_key: str,
    marker: Sequence[int],
    patch: int,
    count: Any,
) -> Any:
    """Item ``index``'s replacement: the marker's start token, ``count(grid)`` patch tokens (the
    positions that receive the item's embeddings), the marker's end token."""

    def expand(index: int) -> PromptUpdateDetails:
        tokens = [marker[0], *[patch] * count(outputs[index][grid_key].tolist()), marker[-1]]
        return PromptUpdateDetails.select_token_id(tokens, patch)

    return expand
