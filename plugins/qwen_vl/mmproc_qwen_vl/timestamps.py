"""Qwen3-VL / Qwen3.5 videos: where each frame came from, and the timestamps the prompt shows.

transformers' ``Qwen3VLProcessor`` (5.25) writes each video's placeholder as one block per
temporal patch (a pair of frames): ``<t seconds><|vision_start|>`` + pads + ``<|vision_end|>``
(the start and end around the placeholder itself dropped), where ``t`` is the mean time of the
pair's two frames, each ``source index / source fps``,
printed with one decimal (``f"{t:.1f}"``: 0.25 reads ``0.2``). An odd frame count repeats the
last frame (its index too). The times come from the video's metadata:

* a video file mmproc decoded: its ``VideoMetadata`` (the source's fps, the sampled frames'
  source indices);
* frames a caller gave with a ``VideoMetadata``: the same, as given;
* frames given without metadata: :func:`default_source` — the frames are taken as sampled at
  the model's own rate (the video processor's ``fps``, 2 for every Qwen3-VL and Qwen3.5
  checkpoint) from the start, frame ``i`` at ``i / fps`` seconds, as qwen-vl-utils assumes for
  frames given as a list. transformers would assume 24 fps instead, and sample the frames again.

Frames are always kept as given (``do_sample_frames=False``): mmproc sampled a file's already,
and a caller's are the caller's choice. Two kinds of frames transformers refuses are taken as
the image path would take them (:func:`model_frames`): a one-frame video (its frame repeated to
fill the temporal patch, as transformers pads any odd count) and RGBA frames (composited onto
white, as transformers converts an RGBA image).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mmproc.plugin import DEFAULT_VIDEO_FPS, VideoItem
from PIL import Image

from mmproc_qwen_vl.image_fast_path import to_rgb

__all__ = [
    "SourceFrames",
    "default_source",
    "keep_given_frames",
    "model_frames",
    "pair_times",
    "source_frames",
    "timestamp_text",
    "video_call_kwargs",
]


@dataclass(frozen=True, slots=True)
class SourceFrames:
    """Where a video's frames came from: each frame's index in its source, and the source's
    frame rate (frames per second)."""

    indices: tuple[int, ...]
    fps: float


def model_fps(video_processor: Any) -> float:
    """The rate the model's videos are sampled at: the video processor's ``fps`` (2 when it
    names none, as qwen-vl-utils)."""
    return float(getattr(video_processor, "fps", None) or DEFAULT_VIDEO_FPS)


def default_source(num_frames: int, video_processor: Any) -> SourceFrames:
    """The documented default for frames given without metadata: sampled at the model's rate
    (:func:`model_fps`) from the start, frame ``i`` at ``i / fps`` seconds."""
    return SourceFrames(tuple(range(num_frames)), model_fps(video_processor))


def source_frames(video: VideoItem, video_processor: Any, index: int = 0) -> SourceFrames:
    """The source frames of ``video``: from its metadata, else :func:`default_source`.

    Raises:
        ValueError: metadata whose fps is not a positive number (``index`` names the video in
            the message).
    """
    metadata = video.metadata
    if metadata is None:
        return default_source(video.num_frames, video_processor)
    fps = float(metadata.fps)
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(
            f"video {index}: its metadata's fps is {metadata.fps!r}; the frame timestamps need "
            "a positive frame rate"
        )
    return SourceFrames(tuple(int(i) for i in metadata.frame_indices), fps)


def pair_times(source: SourceFrames, temporal_patch_size: int) -> list[float]:
    """The time of each temporal patch, in seconds: transformers' arithmetic step for step
    (``Qwen3VLProcessor._calculate_timestamps``), so the printed values agree."""
    indices = list(source.indices)
    if len(indices) % temporal_patch_size:
        indices.extend([indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size))
    times = [index / source.fps for index in indices]
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(times), temporal_patch_size)
    ]


def timestamp_text(seconds: float) -> str:
    """The prompt text of one temporal patch's time: ``<0.2 seconds>``."""
    return f"<{seconds:.1f} seconds>"


def model_frames(video: VideoItem, temporal_patch_size: int) -> np.ndarray:
    """``video``'s frames as transformers' video processor takes them: RGBA frames composited
    onto white (the image path's conversion), and a video shorter than one temporal patch
    filled with copies of its last frame (what transformers does to any odd count)."""
    frames = video.frames
    if frames.shape[-1] == 4:
        frames = np.stack([np.asarray(to_rgb(Image.fromarray(frame, "RGBA"))) for frame in frames])
    if len(frames) < temporal_patch_size:
        frames = np.concatenate(
            [frames, np.repeat(frames[-1:], temporal_patch_size - len(frames), 0)]
        )
    return frames


def _hf_metadata(video: VideoItem, source: SourceFrames, frames: np.ndarray) -> dict[str, Any]:
    """transformers' ``VideoMetadata`` fields for ``video``, whose frames became ``frames``
    (:func:`model_frames`: the indices padded as the frames were)."""
    indices = list(source.indices)
    indices += [indices[-1]] * (len(frames) - len(indices))
    metadata = video.metadata
    total = metadata.total_frames if metadata is not None else len(indices)
    return {
        "total_num_frames": total,
        "fps": source.fps,
        "duration": metadata.duration_s if metadata is not None else total / source.fps,
        "frames_indices": indices,
        "height": int(frames.shape[1]),
        "width": int(frames.shape[2]),
    }


def video_call_kwargs(
    videos: Sequence[VideoItem], video_processor: Any, hf_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The processor keywords for ``videos``: their frames (:func:`model_frames`), each one's
    metadata (:func:`source_frames`), and ``do_sample_frames=False``.

    Raises:
        ValueError: the caller asks transformers to sample the frames again, or a video's
            metadata has no usable fps.
    """
    if hf_kwargs.get("do_sample_frames"):
        raise ValueError(
            "do_sample_frames=True: mmproc keeps the frames a caller gives as they are and "
            "samples video files itself (the video_sampling option)"
        )
    temporal = int(video_processor.temporal_patch_size)
    frames = [model_frames(video, temporal) for video in videos]
    metadata = [
        _hf_metadata(video, source_frames(video, video_processor, index), array)
        for index, (video, array) in enumerate(zip(videos, frames, strict=True))
    ]
    return {"videos": frames, "video_metadata": metadata, "do_sample_frames": False}


def _videos_at_model_fps(self: Any, videos: Any, **kwargs: Any) -> Any:
    """``ProcessorMixin._process_videos``, with frames given without metadata taken as the
    plugin takes them: kept as given, at the model's rate (:func:`default_source`)."""
    if kwargs.get("video_metadata") is None:
        from transformers.video_utils import make_batched_videos

        batched = make_batched_videos(videos)
        source = [default_source(len(video), self.video_processor) for video in batched]
        kwargs["video_metadata"] = [
            {
                "total_num_frames": len(s.indices),
                "fps": s.fps,
                "duration": len(s.indices) / s.fps,
                "frames_indices": list(s.indices),
            }
            for s in source
        ]
        if not kwargs.get("do_sample_frames"):
            kwargs["do_sample_frames"] = False
    return type(self)._process_videos(self, videos, **kwargs)


def keep_given_frames(processor: Any) -> Any:
    """Make ``processor`` (a ``Qwen3VLProcessor``) take frames given without metadata as mmproc
    does, so that calling it directly agrees with mmproc's results: bound with
    ``types.MethodType``, so each worker's deep copy rebinds it to itself."""
    bound: Callable[..., Any] = types.MethodType(_videos_at_model_fps, processor)
    processor._process_videos = bound
    return processor
