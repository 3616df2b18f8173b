"""Shared fixtures of the glm4v plugin's tests: videos with their metadata (GLM writes each
frame pair's time into the prompt, and refuses frames without them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from mmproc.plugin import VideoItem
from mmproc.testing.media import timed_video


@pytest.fixture(scope="session")
def video_with_metadata() -> Callable[..., VideoItem]:
    """The kit's :func:`~mmproc.testing.media.timed_video`: frames as a clip sampled at a rate
    (``fps``, from source frame ``first``), as a caller gives decoded frames."""
    return timed_video
