"""mmproc.media.policy: the media settings, checked when built, and the frame-count rule."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from pathlib import Path
from typing import Any

import pytest
from mmproc.errors import ConfigurationError
from mmproc.media import (
    ALLOWED_MEDIA_PATHS_ENV,
    AudioFormat,
    MediaLimits,
    MediaOptions,
    RemoteMedia,
    VideoSampling,
    allowed_media_paths_from_env,
)

QWEN2_VL = VideoSampling(fps=2.0, min_frames=4, max_frames=768, frame_multiple=2)


def test_video_sampling_defaults_to_two_frames_per_second() -> None:
    assert VideoSampling().fps == 2.0
    assert VideoSampling().num_frames is None
    assert VideoSampling(num_frames=8).fps is None


def test_fps_and_num_frames_are_exclusive() -> None:
    with pytest.raises(ConfigurationError, match="give fps or num_frames, not both"):
        VideoSampling(fps=1.0, num_frames=8)
    with pytest.raises(ConfigurationError, match="not both"):
        dataclasses.replace(VideoSampling(), num_frames=8)
    assert dataclasses.replace(VideoSampling(), num_frames=8, fps=None).num_frames == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fps": 0}, "VideoSampling.fps"),
        ({"fps": float("nan")}, "VideoSampling.fps"),
        ({"num_frames": -1}, "VideoSampling.num_frames"),
        ({"min_frames": 0}, "VideoSampling.min_frames"),
        ({"max_frames": 2.5}, "VideoSampling.max_frames"),
        ({"frame_multiple": True}, "VideoSampling.frame_multiple"),
        ({"min_frames": 8, "max_frames": 4}, "VideoSampling.max_frames"),
        ({"max_frames": 1, "frame_multiple": 2}, "VideoSampling.max_frames"),
    ],
)
def test_bad_video_sampling_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field.replace(".", r"\.")):
        VideoSampling(**kwargs)


@pytest.mark.parametrize(
    ("sampling", "duration", "available", "expected"),
    [
        (VideoSampling(), 3.0, 90, 6),  # one frame every 0.5 s from 0: 0, 0.5, ..., 2.5
        (VideoSampling(), 2.9, 87, 6),  # 2.5 s is still inside the clip
        (VideoSampling(fps=30), 0.1, 3, 3),  # float error does not add a frame
        (VideoSampling(), 0.01, 1, 1),  # at least one
        (VideoSampling(fps=10), 3.0, 6, 6),  # never more than the clip has
        (VideoSampling(num_frames=8), 100.0, 3000, 8),
        (VideoSampling(num_frames=8), 1.0, 5, 5),
        (VideoSampling(min_frames=4), 0.5, 30, 4),
        (VideoSampling(max_frames=10), 60.0, 1800, 10),
        (QWEN2_VL, 1.0, 30, 4),  # min_frames
        (QWEN2_VL, 2.5, 75, 4),  # 5 rounded down to the multiple
        (QWEN2_VL, 3.0, 90, 6),
        (QWEN2_VL, 1000.0, 30000, 768),  # max_frames
        (QWEN2_VL, 10.0, 3, 2),  # fewer frames than min_frames: what the clip has, even
        (QWEN2_VL, 0.1, 1, 2),  # fewer frames than the multiple: a frame is taken twice
        (VideoSampling(min_frames=3, max_frames=9, frame_multiple=2), 0.1, 30, 4),  # bounds inward
        (VideoSampling(min_frames=3, max_frames=9, frame_multiple=2), 100.0, 3000, 8),
        (VideoSampling(num_frames=7, frame_multiple=2), 10.0, 300, 6),
        (VideoSampling(), 3.0, 0, 0),
    ],
)
def test_frame_count_rule(
    sampling: VideoSampling, duration: float, available: int, expected: int
) -> None:
    assert sampling.frame_count(duration, available) == expected


def test_audio_format_checks_its_fields() -> None:
    assert AudioFormat() == AudioFormat(sample_rate=None, mono=False)
    with pytest.raises(ConfigurationError, match=r"AudioFormat\.sample_rate"):
        AudioFormat(sample_rate=0)
    with pytest.raises(ConfigurationError, match=r"AudioFormat\.mono"):
        AudioFormat(mono="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field",
    [
        "max_item_bytes",
        "read_timeout_s",
        "max_video_seconds",
        "max_video_frames",
        "max_audio_seconds",
        "max_request_decoded_bytes",
    ],
)
def test_every_limit_may_be_none_and_must_be_positive(field: str) -> None:
    assert getattr(MediaLimits(**{field: None}), field) is None
    with pytest.raises(ConfigurationError, match=rf"MediaLimits\.{field} must be a positive"):
        MediaLimits(**{field: 0})


def test_remote_media_normalises_domains_and_networks() -> None:
    remote = RemoteMedia(
        allowed_domains=["Example.COM.", "*.cdn.example"], allowed_networks=["10.1.0.0/16"]
    )
    assert remote.allowed_domains == ("example.com", "*.cdn.example")
    assert remote.allowed_networks == (ipaddress.ip_network("10.1.0.0/16"),)
    assert hash(remote) == hash(dataclasses.replace(remote))  # usable as a cache key


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"allowed_domains": "example.com"}, "allowed_domains must be a sequence"),
        ({"allowed_domains": ["a.*.example"]}, "not a host name"),
        ({"allowed_domains": ["https://example.com"]}, "not a host name"),
        ({"allowed_networks": ["10.0.0.0/33"]}, "not a network"),
        ({"allowed_networks": "10.0.0.0/8"}, "allowed_networks must be a sequence"),
        ({"max_redirects": -1}, "max_redirects"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"allow_private_addresses": 1}, "allow_private_addresses"),
    ],
)
def test_bad_remote_media_names_the_field(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        RemoteMedia(**kwargs)


def test_media_options_resolve_allowed_paths(tmp_path: Path) -> None:
    real = tmp_path / "media"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    options = MediaOptions(allowed_paths=[str(link), tmp_path / "media" / ".." / "media"])
    assert options.allowed_paths == (real, real)
    assert MediaOptions().allowed_paths is None
    assert MediaOptions(allowed_paths=[]).allowed_paths == ()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"allowed_paths": "/srv/media"}, "allowed_paths must be a sequence"),
        ({"allowed_paths": [""]}, "not a directory path"),
        ({"video": AudioFormat()}, "MediaOptions.video must be a VideoSampling"),
        ({"limits": None}, "MediaOptions.limits must be a MediaLimits"),
        ({"remote": {"timeout_s": 1}}, "MediaOptions.remote must be a RemoteMedia"),
    ],
)
def test_bad_media_options_name_the_field(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        MediaOptions(**kwargs)


def test_allowed_media_paths_from_the_environment(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert allowed_media_paths_from_env({}) is None  # unset: any path
    assert allowed_media_paths_from_env({ALLOWED_MEDIA_PATHS_ENV: ""}) == ()  # set, empty: none
    assert allowed_media_paths_from_env({ALLOWED_MEDIA_PATHS_ENV: os.pathsep}) == ()
    value = f"{a}{os.pathsep}{os.pathsep}{b}/sub/.."
    assert allowed_media_paths_from_env({ALLOWED_MEDIA_PATHS_ENV: value}) == (a, b)


def test_allowed_media_paths_reads_os_environ_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALLOWED_MEDIA_PATHS_ENV, str(tmp_path))
    assert allowed_media_paths_from_env() == (tmp_path.resolve(),)
    monkeypatch.delenv(ALLOWED_MEDIA_PATHS_ENV)
    assert allowed_media_paths_from_env() is None
