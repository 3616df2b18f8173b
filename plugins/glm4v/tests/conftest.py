"""Shared helpers of the glm4v plugin's tests: videos with their metadata, and a processor whose
transformers side takes them as a user hands transformers a video and its metadata."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from mmproc.plugin import VideoItem, VideoMetadata, hf_video_kwargs


def with_metadata(frames: np.ndarray, fps: float = 2.0, first: int = 0) -> VideoItem:
    """``frames`` as a video sampled one frame in ``1 / fps`` s from source frame ``first``
    of a clip at ``fps``: the metadata a caller gives with decoded frames."""
    count = len(frames)
    indices = tuple(range(first, first + count))
    return VideoItem(
        frames,
        VideoMetadata(
            fps=fps,
            duration_s=(first + count) / fps,
            total_frames=first + count,
            frame_indices=indices,
            timestamps_s=tuple(i / fps for i in indices),
            width=int(frames.shape[2]),
            height=int(frames.shape[1]),
        ),
    )


class TransformersWithMetadata:
    """A transformers processor that takes mmproc's :class:`~mmproc.plugin.VideoItem` under
    ``videos=``, handing it the frames and their metadata (``hf_video_kwargs``) as a user would;
    everything else is the processor's."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processor, name)

    def __call__(self, videos: Any = None, **kwargs: Any) -> Any:
        if videos:
            kwargs.update(hf_video_kwargs(list(videos)))
        return self._processor(**kwargs)


@pytest.fixture(scope="session")
def video_with_metadata() -> Callable[..., VideoItem]:
    """:func:`with_metadata`, for test modules."""
    return with_metadata


@pytest.fixture(scope="session")
def transformers_with_metadata() -> Callable[[Any], TransformersWithMetadata]:
    """:class:`TransformersWithMetadata`, for test modules."""
    return TransformersWithMetadata
