"""Synthetic media for plugin tests, and the HF processor called directly on them.

``noise_image`` gives a picture in any Pillow mode (a palette image with a transparent index
too, as GIFs have), ``noise_video`` random frames, ``media_items`` a list of items of a modality
(smooth pictures, short clips, tones); ``timed_video`` frames with the metadata of a clip sampled
at a rate (what a caller gives with decoded frames, for models that write frame times into the
prompt); ``call_hf_processor`` calls a transformers processor on a prompt and items the way a user
would, which is the reference mmproc's outputs must equal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from mmproc.media.items import VideoItem, VideoMetadata
from mmproc.model_folder import HF_MODALITY_KWARGS, hf_video_kwargs

__all__ = ["call_hf_processor", "media_items", "noise_image", "noise_video", "timed_video"]


def noise_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels in ``mode`` (every resampling weight shows in the output).

    ``mode`` is any Pillow mode, or ``"P+transparency"``: a 16-colour palette image whose
    index 3 is transparent.
    """
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P+transparency":
        image = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        return image
    return rgba if mode == "RGBA" else rgba.convert(mode)


def noise_video(frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """A ``(frames, height, width, 3)`` uint8 video of random frames."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def media_items(
    modality: str,
    count: int,
    *,
    seed: int,
    sizes: Sequence[tuple[int, int]] = ((64, 48),),
    frame_counts: Sequence[int] = (4,),
) -> list[Any]:
    """``count`` items of ``modality``: smooth RGB pictures of ``sizes`` (width, height), taken in
    turn; uint8 videos of those sizes with ``frame_counts`` frames, taken in turn; 0.5-2 s tones
    at 16 kHz."""
    rng = np.random.default_rng(seed)
    items: list[Any] = []
    for index in range(count):
        width, height = sizes[(seed + index) % len(sizes)]
        if modality == "audio":
            seconds = 0.5 + 0.5 * ((seed + index) % 4)
            t = np.arange(int(16000 * seconds), dtype=np.float32) / 16000
            tone = 0.3 * np.sin(2 * np.pi * (200 + 40 * index + 7 * seed) * t)
            items.append((tone.astype(np.float32), 16000))
            continue
        frames = frame_counts[(seed + index) % len(frame_counts)] if modality == "video" else 1
        base = rng.integers(0, 256, (frames, height // 4 + 2, width // 4 + 2, 3), dtype=np.uint8)
        # Upsampled noise: structure a resize treats like a photo's, not white noise.
        smooth = np.ascontiguousarray(base.repeat(4, axis=1).repeat(4, axis=2)[:, :height, :width])
        items.append(smooth if modality == "video" else Image.fromarray(smooth[0]))
    return items


def call_hf_processor(
    processor: Any, prompt: str, mm_data: Mapping[str, Sequence[Any]] | None = None, **kwargs: Any
) -> Any:
    """``processor(text=[prompt], <modality keyword>=items, return_tensors="pt", **kwargs)``.

    Audio items are ``(waveform, sample_rate)`` pairs, given as ``audio=`` and
    ``sampling_rate=``; videos given as :class:`~mmproc.media.items.VideoItem` go as their
    frames and metadata (``hf_video_kwargs``); images and other videos go under their HF keyword
    as they are.
    """
    call: dict[str, Any] = {"text": [prompt], "return_tensors": "pt"}
    for modality, items in (mm_data or {}).items():
        if not items:
            continue
        if modality == "audio":
            call["audio"] = [waveform for waveform, _ in items]
            call["sampling_rate"] = items[0][1]
        elif modality == "video" and any(isinstance(item, VideoItem) for item in items):
            call.update(
                hf_video_kwargs(
                    [item if isinstance(item, VideoItem) else VideoItem(item) for item in items]
                )
            )
        else:
            call[HF_MODALITY_KWARGS[modality]] = list(items)
    call.update(kwargs)
    return processor(**call)


def timed_video(frames: np.ndarray, fps: float = 2.0, first: int = 0) -> VideoItem:
    """``frames`` (``(T, H, W, 3)`` uint8) as a clip at ``fps`` from source frame ``first``, one
    source frame each: the metadata a caller gives with decoded frames."""
    frames = np.ascontiguousarray(frames)
    indices = tuple(range(first, first + len(frames)))
    return VideoItem(
        frames,
        VideoMetadata(
            fps=fps,
            duration_s=(first + len(frames)) / fps,
            total_frames=first + len(frames),
            frame_indices=indices,
            timestamps_s=tuple(i / fps for i in indices),
            width=int(frames.shape[2]),
            height=int(frames.shape[1]),
        ),
    )
