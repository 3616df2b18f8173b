"""mmproc.media.video: video files decoded with PyAV, sampled in time, only the needed frames
decoded; every bad file a MediaItemError, after which a good one still parses.

The clips are made here with PyAV (mmproc.testing.samples): 64x48, frame i a flat grey level that
says i, so each test can tell which source frames were sampled.
"""

from __future__ import annotations

import base64
import io
import struct
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from mmproc.errors import MediaItemError
from mmproc.hashing import hash_item
from mmproc.inputs import parse_mm_data
from mmproc.media import MediaLimits, MediaOptions, VideoSampling
from mmproc.media.items import VideoItem, VideoMetadata
from mmproc.testing.samples import encode_audio, encode_video, frame_number, numbered_frames, tone
from PIL import Image

CODECS = [
    ("mp4", "libx264"),
    ("webm", "libvpx-vp9"),
    ("webm", "libvpx"),
    ("matroska", "libx264"),
    ("avi", "mpeg4"),
    ("mpegts", "libx264"),
]


@pytest.fixture(scope="module")
def clip() -> bytes:
    """3 s at 10 fps (30 frames), mp4 / H.264."""
    return encode_video(numbered_frames(30))


def _video(item: Any, options: MediaOptions | None = None) -> VideoItem:
    parsed = parse_mm_data({"video": item}, media=options)["video"]
    assert len(parsed) == 1
    return parsed[0]


def _sampled(video: VideoItem) -> list[int]:
    return [frame_number(frame) for frame in video.frames]


def _sampling(**kwargs: Any) -> MediaOptions:
    return MediaOptions(video=VideoSampling(**kwargs))


def _refused(item: Any, options: MediaOptions | None = None) -> MediaItemError:
    """Parse ``item`` as a video, return the error — once a good clip has been seen to parse
    with the same options after it."""
    with pytest.raises(MediaItemError) as info:
        parse_mm_data({"video": [item]}, media=options)
    assert (info.value.modality, info.value.index) == ("video", 0)
    good = encode_video(numbered_frames(4))
    assert _video(good, options).frames.shape[1:] == (48, 64, 3)
    return info.value


# --- decoding and sampling -----------------------------------------------------------------------


@pytest.mark.parametrize(("container", "codec"), CODECS)
def test_each_container_and_codec_is_sampled_at_two_frames_per_second(
    container: str, codec: str
) -> None:
    video = _video(encode_video(numbered_frames(30), container=container, codec=codec))
    assert video.frames.dtype == np.uint8
    assert video.frames.flags.c_contiguous
    assert video.frames.shape == (6, 48, 64, 3)
    assert _sampled(video) == [0, 5, 10, 15, 20, 25]
    assert video.metadata == VideoMetadata(
        fps=10.0,
        duration_s=3.0,
        total_frames=30,
        frame_indices=(0, 5, 10, 15, 20, 25),
        timestamps_s=(0.0, 0.5, 1.0, 1.5, 2.0, 2.5),
        width=64,
        height=48,
    )


def test_every_encoded_form_gives_the_same_item(clip: bytes, tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    forms = {
        "bytes": clip,
        "bytearray": bytearray(clip),
        "memoryview": memoryview(clip),
        "str path": str(path),
        "path": path,
        "data url": "data:video/mp4;base64," + base64.b64encode(clip).decode(),
    }
    hashes = {name: hash_item("video", _video(form)) for name, form in forms.items()}
    assert len(set(hashes.values())) == 1, hashes


def test_the_hash_follows_the_sampled_frames_and_their_times(clip: bytes) -> None:
    at_2fps = _video(clip)
    at_1fps = _video(clip, _sampling(fps=1))
    assert hash_item("video", at_2fps) != hash_item("video", at_1fps)
    # The same frames said to be at other times are another item.
    assert at_2fps.metadata is not None
    moved = VideoItem(
        at_2fps.frames,
        VideoMetadata(
            **{
                **{f: getattr(at_2fps.metadata, f) for f in VideoMetadata.__dataclass_fields__},
                "timestamps_s": (0.0, 0.6, 1.2, 1.8, 2.4, 3.0),
            }
        ),
    )
    assert hash_item("video", moved) != hash_item("video", at_2fps)


def test_a_file_with_the_wrong_extension_is_read_by_its_content(tmp_path: Path) -> None:
    webm = encode_video(numbered_frames(30), container="webm", codec="libvpx-vp9")
    path = tmp_path / "actually_webm.mp4"
    path.write_bytes(webm)
    assert _sampled(_video(path)) == [0, 5, 10, 15, 20, 25]
    assert "not decoded" not in repr(_video(path))


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"fps": 1}, [0, 10, 20]),
        ({"fps": 10}, list(range(30))),
        ({"fps": 30}, list(range(30))),  # never more frames than the clip has
        ({"num_frames": 4}, [0, 7, 15, 22]),
        ({"num_frames": 1}, [0]),
        ({"fps": 0.5, "min_frames": 4}, [0, 7, 15, 22]),
        ({"fps": 10, "max_frames": 3}, [0, 10, 20]),
        (
            {"fps": 2, "min_frames": 4, "max_frames": 768, "frame_multiple": 2},
            [0, 5, 10, 15, 20, 25],
        ),
        ({"fps": 1.5, "frame_multiple": 2}, [0, 7, 15, 22]),  # 4.5 frames, rounded down to 4
    ],
)
def test_sampling_policies(clip: bytes, sampling: dict[str, Any], expected: list[int]) -> None:
    video = _video(clip, _sampling(**sampling))
    assert _sampled(video) == expected
    assert video.metadata is not None
    assert list(video.metadata.frame_indices) == expected


def test_a_clip_shorter_than_the_frame_multiple_repeats_its_frame() -> None:
    one_frame = encode_video(numbered_frames(1))
    video = _video(one_frame, _sampling(fps=2, frame_multiple=2))
    assert _sampled(video) == [0, 0]
    assert video.metadata is not None
    assert video.metadata.timestamps_s == (0.0, 0.0)


@pytest.mark.parametrize("container", ["mp4", "matroska", "webm"])
def test_a_variable_frame_rate_is_sampled_evenly_in_time(container: str) -> None:
    times = [0.0, 0.1, 0.2, 1.5, 1.6, 2.9]
    codec = "libvpx-vp9" if container == "webm" else "libx264"
    data = encode_video(numbered_frames(6), container=container, codec=codec, timestamps_s=times)
    video = _video(data)
    # Sample times 0, 0.5, ..., 2.5: the frame on screen at each.
    assert _sampled(video) == [0, 2, 2, 3, 4, 4]
    assert video.metadata is not None
    assert video.metadata.timestamps_s == (0.0, 0.2, 0.2, 1.5, 1.6, 1.6)
    assert video.metadata.duration_s == pytest.approx(3.0)
    assert video.metadata.total_frames == 6


def _every_frame(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.mark.parametrize(
    ("container", "codec"),
    [
        ("mp4", "libx264"),
        ("webm", "libvpx-vp9"),
        ("avi", "libx264"),  # AVI has no timestamps: B-frames get made-up ones
    ],
)
@pytest.mark.parametrize("num_frames", [1, 3, 8])
def test_decoding_only_the_needed_frames_gives_what_decoding_all_gives(
    container: str, codec: str, num_frames: int
) -> None:
    # A keyframe every 10 frames, B-frames (x264's default): most groups are skipped, and
    # frames not sampled are skipped when nothing refers to them. Where the timestamps are made
    # up, frames are taken by their position in the decoded stream instead.
    data = encode_video(
        numbered_frames(64, 96, 64) + np.arange(96, dtype=np.uint8)[None, None, :, None],
        container=container,
        codec=codec,
        options={"g": "10"},
    )
    video = _video(data, _sampling(num_frames=num_frames, fps=None))
    assert video.metadata is not None
    everything = _every_frame(data)
    assert np.array_equal(video.frames, everything[list(video.metadata.frame_indices)])


def test_the_frames_suit_transformers_video_metadata(clip: bytes) -> None:
    video = _video(clip)
    assert video.metadata is not None
    hf = video.metadata.to_transformers()
    assert (hf.total_num_frames, hf.fps, hf.duration) == (30, 10.0, 3.0)
    assert (hf.width, hf.height, hf.video_backend) == (64, 48, "pyav")
    assert hf.frames_indices == [0, 5, 10, 15, 20, 25]
    assert hf.timestamps == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert video.metadata.sampled_fps == 2.0


def test_a_qwen2_vl_video_processor_takes_a_decoded_mp4(clip: bytes) -> None:
    transformers = pytest.importorskip("transformers")
    video = _video(clip, _sampling(fps=2, min_frames=4, max_frames=768, frame_multiple=2))
    assert video.metadata is not None
    processor = transformers.Qwen2VLVideoProcessor()
    out = processor(
        videos=[video.frames],
        video_metadata=[video.metadata.to_transformers()],
        do_sample_frames=False,
        return_tensors="pt",
    )
    t, h, w = out["video_grid_thw"][0].tolist()
    assert t == video.num_frames // 2  # temporal patches of two frames
    assert out["pixel_values_videos"].shape[0] == t * h * w


def test_frames_given_decoded_are_not_resampled() -> None:
    frames = numbered_frames(30)
    video = _video(frames, _sampling(fps=1))
    assert video.frames is frames
    assert video.metadata is None


def test_the_audio_track_does_not_disturb_the_video() -> None:
    data = encode_video(numbered_frames(30), audio=(tone(3.0, 16000), 16000))
    assert _sampled(_video(data)) == [0, 5, 10, 15, 20, 25]


# --- bad files -----------------------------------------------------------------------------------


def test_a_video_without_frames_is_refused() -> None:
    err = _refused(encode_video([]))
    assert err.reason == "no video stream in the file (streams: none)"


def test_an_audio_file_is_not_a_video() -> None:
    err = _refused(encode_audio(tone(1.0, 16000), 16000, "m4a"))
    assert err.reason == "no video stream in the file (streams: audio)"


def test_an_image_is_not_a_video() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "PNG")
    err = _refused(buf.getvalue())
    assert err.reason.startswith("not a supported container (allowed: mov, mp4, matroska")


@pytest.mark.parametrize(
    ("container", "codec", "cut", "needle"),
    [
        ("mp4", "libx264", 0.5, "cannot open it"),  # the index (moov) is at the end
        ("mp4", "libx264", 0.9, "cannot open it"),
        ("webm", "libvpx-vp9", 0.6, "truncated or corrupt: the header says 3.0 s"),
        ("avi", "mpeg4", 0.9, "truncated or corrupt: the header promises 30 frames"),
        ("avi", "mpeg4", 0.5, "cannot open it"),
    ],
)
def test_a_truncated_file_is_refused(container: str, codec: str, cut: float, needle: str) -> None:
    data = encode_video(numbered_frames(30), container=container, codec=codec)
    assert needle in _refused(data[: int(len(data) * cut)]).reason


def test_a_file_garbled_in_the_middle_is_refused() -> None:
    data = bytearray(encode_video(numbered_frames(30), container="webm", codec="libvpx-vp9"))
    middle = len(data) // 2
    data[middle : middle + 200] = np.random.default_rng(0).integers(0, 256, 200, np.uint8).tobytes()
    assert "truncated or corrupt" in _refused(bytes(data)).reason


def test_a_corrupt_transport_stream_packet_is_refused() -> None:
    data = bytearray(encode_video(numbered_frames(30), container="mpegts"))
    middle = len(data) // 2
    data[middle : middle + 200] = np.random.default_rng(0).integers(0, 256, 200, np.uint8).tobytes()
    assert _refused(bytes(data)).reason.startswith("corrupt or truncated data at packet ")


@pytest.mark.parametrize("data", [b"", b"\x00" * 100, np.random.default_rng(2).bytes(5000)])
def test_garbage_is_refused(data: bytes) -> None:
    err = _refused(data)
    assert err.reason.startswith(("empty file", "not a supported container", "cannot open it"))


# --- limits --------------------------------------------------------------------------------------


def test_a_video_longer_than_the_limit_is_refused_before_decoding(clip: bytes) -> None:
    err = _refused(clip, MediaOptions(limits=MediaLimits(max_video_seconds=2.5)))
    assert err.reason == "3.0 s is over the limit of 2.5 s (MediaLimits.max_video_seconds)"
    assert _video(clip, MediaOptions(limits=MediaLimits(max_video_seconds=3.0))).num_frames == 6


def test_a_video_whose_header_understates_its_length_is_cut_while_reading() -> None:
    data = encode_video(numbered_frames(30), container="webm", codec="libvpx-vp9")
    # WebM's Segment Duration (element 0x4489, an 8-byte float in ms): claim 0.5 s.
    at = data.index(b"\x44\x89\x88") + 3
    lying = data[:at] + struct.pack(">d", 500.0) + data[at + 8 :]
    err = _refused(lying, MediaOptions(limits=MediaLimits(max_video_seconds=1.0)))
    assert err.reason.startswith("frames go past ")
    assert err.reason.endswith("over the limit of 1 s (MediaLimits.max_video_seconds)")


def test_more_sampled_frames_than_the_limit_are_refused(clip: bytes) -> None:
    limits = MediaLimits(max_video_frames=5)
    err = _refused(clip, MediaOptions(limits=limits))
    assert err.reason == "6 sampled frames is over the limit of 5 (MediaLimits.max_video_frames)"
    fewer = MediaOptions(video=VideoSampling(max_frames=5), limits=limits)
    assert _video(clip, fewer).num_frames == 5


def test_the_frame_limit_applies_to_frames_given_decoded() -> None:
    limits = MediaOptions(limits=MediaLimits(max_video_frames=3))
    err = _refused(numbered_frames(4), limits)
    assert err.reason == "4 frames is over the limit of 3 (MediaLimits.max_video_frames)"
    assert "over the limit of 3" in _refused(list(numbered_frames(4)), limits).reason


def test_frames_over_the_pixel_limit_are_refused(
    clip: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 48 - 1)
    with pytest.raises(MediaItemError, match=r"64x48 = 3072 pixels is over the limit"):
        parse_mm_data({"video": clip})


def test_the_request_decoded_bytes_limit_names_the_item_that_crosses_it(clip: bytes) -> None:
    one = 6 * 48 * 64 * 3
    options = MediaOptions(limits=MediaLimits(max_request_decoded_bytes=one + 100))
    with pytest.raises(MediaItemError) as info:
        parse_mm_data({"video": [clip, clip]}, media=options)
    assert (info.value.modality, info.value.index) == ("video", 1)
    assert info.value.reason == (
        f"its {one:,} decoded bytes bring the request to {2 * one:,}, over the limit of "
        f"{one + 100:,} (MediaLimits.max_request_decoded_bytes)"
    )
    assert len(parse_mm_data({"video": clip}, media=options)["video"]) == 1


def test_a_bad_video_among_good_ones_on_a_pool_is_named(clip: bytes) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(MediaItemError) as info:
            parse_mm_data({"video": [clip, clip[:500], clip]}, io_pool=pool)
        assert info.value.index == 1
        assert len(parse_mm_data({"video": [clip, clip]}, io_pool=pool)["video"]) == 2
