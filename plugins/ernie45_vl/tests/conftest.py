"""Shared fixtures of the ernie45_vl plugin's tests: one folder of each layout, written once per
session, processors on them, and an mp4 clip."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import mmproc
import numpy as np
import pytest
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_ernie45_vl.demo import write_converted_folder, write_original_folder


@pytest.fixture(scope="session")
def converted_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted-layout folder (the ``ernie45-vl`` demo model)."""
    return write_converted_folder(tmp_path_factory.mktemp("ernie") / "converted")


@pytest.fixture(scope="session")
def original_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An original-layout folder (the ``ernie45-vl-original`` demo model)."""
    return write_original_folder(tmp_path_factory.mktemp("ernie") / "original")


@pytest.fixture(scope="module")
def converted(converted_folder: Path) -> Iterator[mmproc.Processor]:
    """The converted folder's processor, normalising on the CPU (floats, as transformers)."""
    with mmproc.get_processor(converted_folder, device_normalize=False) as processor:
        yield processor


@pytest.fixture(scope="module")
def original(original_folder: Path) -> Iterator[mmproc.Processor]:
    """The original folder's processor with its defaults (uint8 pixels, device normalisation)."""
    with mmproc.get_processor(original_folder) as processor:
        yield processor


@pytest.fixture(scope="session")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3.5 s of 64x48 H.264 at 10 fps (each frame shows its number) in an mp4."""
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    path.write_bytes(encode_video(numbered_frames(35), fps=10))
    return path


def frames(count: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """``count`` smooth (T, H, W, 3) uint8 frames: blocky noise, as a resize treats a photo."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (count, height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
    return np.ascontiguousarray(base.repeat(4, axis=1).repeat(4, axis=2)[:, :height, :width])


@pytest.fixture(scope="session")
def make_frames() -> Callable[..., np.ndarray]:
    """:func:`frames`, for test modules (conftest functions are not importable under pytest's
    importlib mode)."""
    return frames
