"""The items media decode to, and the contract every decoder follows.

Items: an image is a loaded ``PIL.Image.Image``; a video a :class:`VideoItem` (its frames, and
:class:`VideoMetadata` when it came from a file); an audio clip an :class:`AudioItem`. These are
what the model hooks receive (``mm_items``) and what is hashed.

The contract: each modality's decoder module (:mod:`mmproc.media.image`, ``video``, ``audio``)
turns what a caller gave into a :class:`DecodePlan`: its decoded size is known before anything
big is allocated, so a request's size can be checked first (:mod:`mmproc.inputs`), and its
:attr:`~DecodePlan.decode` makes the item. The modules import nothing back from the reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmproc.media.policy import MediaOptions

__all__ = [
    "ENCODED_FORMS",
    "MODALITIES",
    "AudioItem",
    "DecodePlan",
    "DecodeSettings",
    "VideoItem",
    "VideoMetadata",
]

MODALITIES: tuple[str, ...] = ("image", "video", "audio")
"""The modality keys ``mm_data`` may have, in the order items are loaded and errors reported."""

ENCODED_FORMS = (bytes, bytearray, memoryview, str, os.PathLike)
"""The types of an item given *encoded*: its bytes, a path, a ``data:`` URL or an http(s) URL."""


# eq=False: a generated __eq__ would compare arrays elementwise (an ambiguous truth value), and
# __hash__ would hash the array; compare items by content with mmproc.hashing.hash_item instead.
@dataclass(frozen=True, slots=True, eq=False)
class AudioItem:
    """One audio clip: ``waveform`` (float32, 1-D or channels-first 2-D) at ``sample_rate`` Hz.

    The waveform is shared with whoever holds it (cache, processor); treat it as read-only.
    """

    waveform: np.ndarray
    sample_rate: int

    @property
    def num_samples(self) -> int:
        """Samples per channel."""
        return int(self.waveform.shape[-1])

    @property
    def duration_s(self) -> float:
        """Length in seconds."""
        return self.num_samples / self.sample_rate


@dataclass(frozen=True, slots=True)
class VideoMetadata:
    """Where the frames of a decoded video file came from: what processors that take video
    metadata (Qwen2.5-VL's ``second_per_grid_ts``, transformers' ``VideoMetadata``) need.

    Frame indices count the source's frames in presentation order from 0; timestamps are in
    seconds from the first frame (for a variable frame rate they are the frames' own times, not
    ``index / fps``).
    """

    fps: float
    """The source's frame rate: its frame count over its duration."""
    duration_s: float
    """The source's length: from its first frame's timestamp to the end of its last frame."""
    total_frames: int
    """Frames in the source."""
    frame_indices: tuple[int, ...]
    """The source index of each sampled frame (a frame may be sampled twice, see
    ``VideoSampling``)."""
    timestamps_s: tuple[float, ...]
    """The timestamp of each sampled frame, in seconds."""
    width: int
    """Frame width in pixels."""
    height: int
    """Frame height in pixels."""

    @property
    def sampled_fps(self) -> float:
        """Sampled frames per second of video (``len(timestamps_s) / duration_s``)."""
        return len(self.timestamps_s) / self.duration_s if self.duration_s > 0 else self.fps

    def to_transformers(self) -> Any:
        """This metadata as ``transformers.video_utils.VideoMetadata``, for HF video processors
        that take ``video_metadata`` (imports transformers)."""
        from transformers.video_utils import VideoMetadata as HFVideoMetadata

        return HFVideoMetadata(
            total_num_frames=self.total_frames,
            fps=self.fps,
            width=self.width,
            height=self.height,
            duration=self.duration_s,
            video_backend="pyav",
            frames_indices=list(self.frame_indices),
        )


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: as AudioItem
class VideoItem:
    """One video: ``frames``, C-contiguous ``uint8`` ``(T, H, W, C)``, and where they came from
    (``metadata``; ``None`` when the caller gave frames rather than a file).

    The frames are shared with whoever holds them; treat them as read-only.
    """

    frames: np.ndarray
    metadata: VideoMetadata | None = None

    @property
    def num_frames(self) -> int:
        """Frames in the item (``T``)."""
        return int(self.frames.shape[0])


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    """What decoding one request's items follows: the encoded image formats allowed (``None``:
    every format Pillow knows) and the media options (:class:`~mmproc.media.policy.MediaOptions`:
    sources, limits, video sampling, audio format)."""

    image_formats: tuple[str, ...] | None
    media: MediaOptions


def _nothing() -> None:
    return None


@dataclass(slots=True)
class DecodePlan:
    """One item whose decoded size is known and whose decoding is still to do.

    ``decode()`` makes the item (raising :class:`~mmproc.media.problem.MediaProblem` when it
    cannot); ``heavy`` says it is worth a thread of the IO pool (a file to decode, a resampling);
    ``discard()`` releases what was opened when the item will not be decoded after all.
    """

    decoded_bytes: int
    decode: Callable[[], Any]
    heavy: bool = False
    discard: Callable[[], None] = field(default=_nothing)

    @classmethod
    def done(cls, item: Any, decoded_bytes: int) -> DecodePlan:
        """A plan for an item that is ready already."""
        return cls(decoded_bytes, lambda: item)
