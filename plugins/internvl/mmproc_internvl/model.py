"""The InternVL3 model hooks (transformers' ``InternVLForConditionalGeneration``).

Each image is cut into 448-pixel tiles of the grid whose aspect ratio is nearest its own (at
most ``max_patches`` tiles, the folder's setting or the request's), plus a thumbnail of the
whole image when there is more than one tile; each ``<IMG_CONTEXT>`` in the prompt becomes
``<img>``, ``image_seq_length`` (256) ``<IMG_CONTEXT>`` per tile, ``</img>``. Each ``<video>``
becomes one such block per frame, each after its ``Frame{i}:`` text, on lines of their own.
Only the ``<IMG_CONTEXT>`` positions receive embeddings.

The processor is transformers' own, keeping images and videos apart
(:class:`mmproc_internvl.loading.InternVLItemsProcessor`); every hook that reads a processor
reads the one it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmproc.plugin import (
    DEFAULT_VIDEO_FPS,
    BatchedField,
    ChannelLayout,
    FieldSpec,
    FlatField,
    MediaFormat,
    ModelContext,
    NormSpec,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    VideoSampling,
    hookimpl,
)
from mmproc_qwen_vl.shared import same_normalisation

from mmproc_internvl.loading import load_internvl_processor

__all__ = ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "InternVLModel", "video_frame_ids"]

IMAGE_PLACEHOLDER = "<IMG_CONTEXT>"
VIDEO_PLACEHOLDER = "<video>"


def _tile_counts(outputs: Mapping[str, Any]) -> list[int]:
    return [int(n) for n in outputs["num_patches"]]


def video_frame_ids(processor: Any, frames: int, lead: str = "") -> list[int]:
    """The token ids a video of ``frames`` frames expands to, as transformers writes it:
    ``Frame{i}: <img>`` + ``<IMG_CONTEXT>`` x ``image_seq_length`` + ``</img>`` per frame, the
    frames joined by newlines, ``lead`` (a space the prompt had before ``<video>``) first.

    Each text between two special tokens is tokenised on its own, as the tokenizer does within
    the whole prompt: special tokens split the text before anything else sees it.
    """
    tokenizer = processor.tokenizer
    block = [
        processor.start_image_token_id,
        *[processor.image_token_id] * int(processor.image_seq_length),
        processor.end_image_token_id,
    ]
    ids: list[int] = []
    for index in range(frames):
        text = f"{lead if index == 0 else chr(10)}Frame{index + 1}: "
        ids += tokenizer.encode(text, add_special_tokens=False) + block
    return ids


class InternVLModel:
    """Hooks for ``InternVLForConditionalGeneration`` (InternVL3 in transformers' form)."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: ``"torchvision"`` (default) or ``"pil"`` image processor."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """transformers' processor, keeping images and videos apart (see
        :mod:`mmproc_internvl.loading`)."""
        return load_internvl_processor(ctx)

    @hookimpl
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """One ``<IMG_CONTEXT>`` per image, one ``<video>`` per video."""
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0) + VIDEO_PLACEHOLDER * mm_counts.get(
            "video", 0
        )

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """Image tiles are flat, ``num_patches`` of them per image; frames one row per video."""
        return {
            "pixel_values": FlatField("image", sizes=_tile_counts),
            "num_patches": BatchedField("image"),
            "pixel_values_videos": BatchedField("video"),
        }

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """``<IMG_CONTEXT>`` becomes the image's tiles' blocks; ``<video>`` its frames' blocks.

        transformers tokenises the expanded prompt as a whole, so a video's ``Frame1:`` joins a
        space the prompt has before ``<video>`` into one token (`` Frame``): a second
        replacement takes that space with the placeholder and gives the joined tokens.
        """
        context = processor.image_token_id
        start, end = processor.start_image_token_id, processor.end_image_token_id
        per_tile = int(processor.image_seq_length)
        updates: list[PromptUpdate] = []
        images = item_outputs.get("image", [])
        if images:

            def tiles(index: int) -> PromptUpdateDetails:
                count = int(images[index]["num_patches"]) * per_tile
                ids = [start, *[context] * count, end]
                return PromptUpdateDetails.select_token_id(ids, context)

            updates.append(PromptReplacement("image", [context], tiles))
        videos = item_outputs.get("video", [])
        if videos:
            video = processor.video_token
            for target, lead in ((" " + video, " "), (video, "")):
                updates.append(PromptReplacement("video", target, _frames(processor, videos, lead)))
        return updates

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat | None:
        """Video files sampled at the video processor's frame count or rate (2 fps when it names
        neither)."""
        video = getattr(processor, "video_processor", None)
        if video is None:
            return None
        count = getattr(video, "num_frames", None)
        if count:
            return MediaFormat(video=VideoSampling(num_frames=int(count), fps=None))
        fps = getattr(video, "fps", None) or DEFAULT_VIDEO_FPS
        return MediaFormat(video=VideoSampling(fps=fps))

    @hookimpl
    def device_norm_spec(self, processor: Any) -> NormSpec | None:
        """Tiles and frames travel as uint8 ``(n, 3, 448, 448)``; the engine normalises them with
        the image processor's settings. ``None`` when the video processor normalises otherwise:
        the raw-pixel switches reach both, and one spec cannot undo two normalisations."""
        image_processor = processor.image_processor
        video = getattr(processor, "video_processor", None)
        if video is not None and not same_normalisation(image_processor, video):
            return None
        return NormSpec.from_image_processor(
            image_processor,
            layout=ChannelLayout.channels_first(),
            pixel_keys=("pixel_values", "pixel_values_videos"),
        )


def _frames(
    processor: Any, videos: Sequence[Mapping[str, Any]], lead: str
) -> Callable[[int], PromptUpdateDetails]:
    context = processor.image_token_id

    def expand(index: int) -> PromptUpdateDetails:
        frames = int(videos[index]["pixel_values_videos"].shape[0])
        return PromptUpdateDetails.select_token_id(
            video_frame_ids(processor, frames, lead), context
        )

    return expand
