"""The LLaVA-OneVision, LLaVA-NeXT and LLaVA-NeXT-Video model hooks.

Images ("anyres"): each image is resized and padded to the canvas of ``image_grid_pinpoints``
that fits it best, cut into tiles of the vision tower's size, and preceded by a base tile of the
whole image; ``pixel_values`` is ``(images, tiles, 3, H, W)`` with every image's tiles padded to
the batch's largest count. Each ``<image>`` becomes as many ``<image>`` tokens as the model has
features for it: the base tile's, the tiles' with the padding's rows and columns taken off
("unpadded"), one newline feature per row, capped at ``anyres_max_9``'s budget for
LLaVA-OneVision. Videos: ``(frames, 3, H, W)`` per video, each ``<video>`` becoming the pooled
features of every frame (LLaVA-OneVision: plus one newline).

The counts are transformers' own (the processor's ``replace_image_token`` /
``replace_video_token``, called on the item's outputs); every hook that reads a processor reads
the one it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmproc.plugin import (
    BatchedField,
    ChannelLayout,
    FieldSpec,
    MediaFormat,
    ModelContext,
    NormSpec,
    PaddedField,
    ProcessingMode,
    PromptReplacement,
    PromptUpdate,
    VideoSampling,
    hookimpl,
)
from mmproc_qwen_vl.shared import same_normalisation

from mmproc_llava.loading import FAMILIES, grid_pinpoints, load_llava_processor

__all__ = ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "LlavaModel", "tile_counts"]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


def tile_counts(
    pinpoints: Sequence[tuple[int, int]],
) -> Callable[[Mapping[str, Any]], list[int]]:
    """Each image's tiles, as the processor cuts them: the base tile and the tiles of the
    best-fitting canvas of ``pinpoints`` (the tile size is the outputs' own)."""
    from transformers.image_processing_utils import select_best_resolution

    candidates = [list(p) for p in pinpoints]

    def counts(outputs: Mapping[str, Any]) -> list[int]:
        height, width = outputs["pixel_values"].shape[-2:]
        best = [select_best_resolution(s, candidates) for s in outputs["image_sizes"].tolist()]
        return [1 + (h // height) * (w // width) for h, w in best]

    return counts


class LlavaModel:
    """Hooks for ``LlavaOnevisionForConditionalGeneration``,
    ``LlavaNextForConditionalGeneration`` and ``LlavaNextVideoForConditionalGeneration``."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: ``"torchvision"`` (default) or ``"pil"`` image processor."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """The family's transformers processor (see :mod:`mmproc_llava.loading`)."""
        return load_llava_processor(ctx)

    @hookimpl
    def process_mm_data(self, mode: ProcessingMode, processor: Any) -> Mapping[str, Any] | None:
        """The processor as it is (``None``: the core calls ``processor``, the worker's clone),
        unless the request retiles its images."""
        if "image_grid_pinpoints" in mode.user_kwargs:
            # Tile counts follow config.json's pinpoints (see mmproc_llava.loading).
            raise ValueError(
                "image_grid_pinpoints cannot change per request: each image's tile count "
                "follows the model's own (config.json)"
            )
        return None

    @hookimpl
    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """One ``<image>`` per image, then one ``<video>`` per video (for the video models)."""
        takes_video = FAMILIES[ctx.architecture].video_processor is not None
        videos = mm_counts.get("video", 0) if takes_video else 0
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0) + VIDEO_PLACEHOLDER * videos

    @hookimpl
    def get_mm_fields(
        self, ctx: ModelContext, outputs: Mapping[str, Any]
    ) -> Mapping[str, FieldSpec]:
        """Tiles padded along dim 1, each image cut to its own count; sizes one row per image;
        frames one row per video."""
        return {
            "pixel_values": PaddedField("image", lengths=tile_counts(grid_pinpoints(ctx)), dim=1),
            "image_sizes": BatchedField("image"),
            "batch_num_images": BatchedField("image"),  # LLaVA-OneVision: 1 for every image
            "pixel_values_videos": BatchedField("video"),
        }

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """Each placeholder becomes as many of itself as transformers' processor gives the
        item."""
        updates: list[PromptUpdate] = []
        images = item_outputs.get("image", [])
        if images:
            updates.append(_repeated(processor, "image", images, _image_inputs))
        videos = item_outputs.get("video", [])
        if videos:
            updates.append(_repeated(processor, "video", videos, _video_inputs))
        return updates

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat | None:
        """Video files sampled at the video processor's frame count or rate, when it names one
        (else the core's 2 fps)."""
        video = getattr(processor, "video_processor", None)
        count = getattr(video, "num_frames", None)
        if count:
            return MediaFormat(video=VideoSampling(num_frames=int(count), fps=None))
        fps = getattr(video, "fps", None)
        return MediaFormat(video=VideoSampling(fps=fps)) if fps else None

    @hookimpl
    def device_norm_spec(self, processor: Any) -> NormSpec | None:
        """Tiles and frames travel as uint8 ``(n, 3, H, W)``; the engine normalises them with
        the image processor's settings. ``None`` when the video processor normalises otherwise
        (the raw-pixel switches reach both; one spec cannot undo two normalisations)."""
        image_processor = processor.image_processor
        video = getattr(processor, "video_processor", None)
        if video is not None and not same_normalisation(image_processor, video):
            return None
        keys = ("pixel_values",) if video is None else ("pixel_values", "pixel_values_videos")
        return NormSpec.from_image_processor(
            image_processor, layout=ChannelLayout.channels_first(), pixel_keys=keys
        )


def _image_inputs(item: Mapping[str, Any]) -> dict[str, Any]:
    # What the processor's replace_image_token reads, for an image alone in its batch.
    return {
        "image_sizes": [item["image_sizes"]],
        "pixel_values": [item["pixel_values"]],
        "batch_num_images": [1],
    }


def _video_inputs(item: Mapping[str, Any]) -> dict[str, Any]:
    return {"pixel_values_videos": [item["pixel_values_videos"]]}


def _repeated(
    processor: Any,
    modality: str,
    items: Sequence[Mapping[str, Any]],
    inputs: Callable[[Mapping[str, Any]], dict[str, Any]],
) -> PromptReplacement:
    """Each placeholder of ``modality`` becomes as many of itself as the processor's own
    ``replace_<modality>_token`` writes for the item (item 0 of a batch of one)."""
    token = getattr(processor, f"{modality}_token")
    token_id = getattr(processor, f"{modality}_token_id")
    replace = getattr(processor, f"replace_{modality}_token")

    def expand(index: int) -> list[int]:
        return [token_id] * replace(inputs(items[index]), 0).count(token)

    return PromptReplacement(modality, [token_id], expand)
