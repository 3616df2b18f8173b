"""Pieces of ``process_mm_data``: calling transformers' Gemma processors on a request's items.

Images and videos go to the processor in one call. Each audio clip goes alone: the feature
extractors pad a batch to its longest clip, and Gemma 3n's then computes frames of a shorter
clip that run past its end into the padding (marked valid), so a clip's features would depend
on the clips it came with. Alone, every clip gets what transformers gives a one-clip request,
whatever its batch; Gemma 4's masked frames are the same alone as in a batch.

Two outputs are handed on per item (:mod:`mmproc_gemma.fields`): Gemma 3's ``pixel_values``,
each image with its pan-and-scan crops (transformers drops ``num_crops``; the count follows
from the image's size, by transformers' own ``pan_and_scan``), and the audio features and masks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from mmproc.plugin import AudioItem, ModelContext, VideoItem

from mmproc_gemma.loading import PAN_AND_SCAN_KEYS

__all__ = [
    "AUDIO_KEYS",
    "VIDEO_FPS_OPTION",
    "clips_alone",
    "crop_counts",
    "kept_samples",
    "media_kwargs",
    "split_crops",
    "video_metadata",
    "warn_truncated",
]

logger = logging.getLogger(__name__)

AUDIO_KEYS = ("input_features", "input_features_mask")
"""The audio feature extractors' outputs."""

VIDEO_FPS_OPTION = "video_fps"
"""The plugin option giving the frame rate of videos given as frames without metadata."""


def video_metadata(video: VideoItem, fps: float | None) -> Any:
    """transformers' ``VideoMetadata`` of a Gemma 4 video: the file's (or the caller's
    ``VideoItem.metadata``), or for bare frames the frame rate of option ``video_fps``.

    Raises:
        ValueError: bare frames and no ``video_fps``: Gemma 4 stamps every frame with its
            ``mm:ss`` time, and transformers would assume 24 fps without a word.
    """
    if video.metadata is not None:
        return video.metadata.to_transformers()
    if fps is None:
        raise ValueError(
            f"its {video.num_frames} frames came without timing: Gemma 4 stamps each "
            "frame with its time, so give the video as a file, as a VideoItem with its "
            f"metadata, or set the plugin option {VIDEO_FPS_OPTION}= (the frames' rate)"
        )
    from transformers.video_utils import VideoMetadata

    height, width = video.frames.shape[1:3]
    return VideoMetadata(
        total_num_frames=video.num_frames,
        fps=float(fps),
        width=int(width),
        height=int(height),
        duration=video.num_frames / float(fps),
        frames_indices=list(range(video.num_frames)),
    )


def kept_samples(feature_extractor: Any, hf_kwargs: Mapping[str, Any]) -> int | None:
    """The samples of a clip the feature extractor keeps (480000, 30 s at 16 kHz: it truncates
    longer clips); ``None`` when the call does not truncate."""
    if not hf_kwargs.get("truncation", True):
        return None
    if hf_kwargs.get("max_length") is not None:
        return int(hf_kwargs["max_length"])
    parameter = inspect.signature(feature_extractor.__call__).parameters.get("max_length")
    return None if parameter is None or parameter.default is None else int(parameter.default)


def warn_truncated(ctx: ModelContext, clips: Sequence[AudioItem], limit: int | None) -> None:
    """Say when transformers will keep only the start of a clip (it does so silently)."""
    for clip in clips:
        if limit is not None and clip.num_samples > limit:
            logger.warning(
                "%s (plugin %r): an audio clip of %.2f s; the feature extractor keeps its first "
                "%.2f s (%d samples) and drops the rest, as transformers does: split longer "
                "audio into several clips",
                ctx.architecture,
                ctx.plugin,
                clip.duration_s,
                limit / clip.sample_rate,
                limit,
            )


def crop_counts(processor: Any, images: Sequence[Any], hf_kwargs: Mapping[str, Any]) -> list[int]:
    """Gemma 3's pan-and-scan crops of each image, as transformers' ``pan_and_scan`` makes them
    with the settings of this call (the request's ``hf_kwargs`` over the processor's)."""
    settings = {**getattr(processor, "images_kwargs", {})}
    settings.update((key, hf_kwargs[key]) for key in PAN_AND_SCAN_KEYS if key in hf_kwargs)
    if not settings.get("do_pan_and_scan"):
        return [0] * len(images)
    import numpy as np

    image_processor = processor.image_processor
    crop = {key: settings[key] for key in PAN_AND_SCAN_KEYS[1:]}
    counts = []
    for image in images:
        # Only the shape is read: a zero-stride stand-in of the image's size, no pixels.
        shape = (1, image.height, image.width)
        if hasattr(image_processor, "pan_and_scan_batched"):  # the torchvision backend
            import torch

            stand_in: Any = torch.zeros((), dtype=torch.uint8).expand(shape)
            counts.append(len(image_processor.pan_and_scan_batched(stand_in, **crop)))
        else:
            stand_in = np.broadcast_to(np.uint8(0), shape)
            counts.append(len(image_processor.pan_and_scan(stand_in, **crop)))
    return counts


def media_kwargs(mm_items: Mapping[str, Sequence[Any]], video_fps: float | None) -> dict[str, Any]:
    """The processor's keywords for a request's images and videos (a video's frames as they
    are, with their metadata: mmproc sampled a file's frames already)."""
    media: dict[str, Any] = {}
    if images := list(mm_items.get("image", ())):
        media["images"] = images
    if videos := list(mm_items.get("video", ())):
        media["videos"] = [video.frames for video in videos]
        media["video_metadata"] = [video_metadata(video, video_fps) for video in videos]
        media["do_sample_frames"] = False
    return media


def clips_alone(
    ctx: ModelContext,
    processor: Any,
    clips: Sequence[AudioItem],
    text: str,
    call: Mapping[str, Any],
) -> dict[str, list[Any]]:
    """Each clip's audio outputs, the processor run on the clip alone (on ``text``, the
    placeholder of one clip, with ``call``'s keywords)."""
    warn_truncated(ctx, clips, kept_samples(processor.feature_extractor, call))
    alone = [processor(text=[text], audio=[clip.waveform], **call) for clip in clips]
    return {key: [one[key][0] for one in alone] for key in AUDIO_KEYS}


def split_crops(
    processor: Any, images: Sequence[Any], pixel_values: Any, hf_kwargs: Mapping[str, Any]
) -> list[Any]:
    """Gemma 3's ``pixel_values`` per image: the image and its crops (views)."""
    sizes = [1 + crops for crops in crop_counts(processor, images, hf_kwargs)]
    return list(pixel_values.split(sizes))
