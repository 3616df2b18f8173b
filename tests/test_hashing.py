"""mmproc.hashing: stable, framed content hashes of items and of the processing context."""

from __future__ import annotations

import enum
import struct
import types
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
import xxhash
from mmproc import hashing
from mmproc.hashing import HASH_ALGORITHMS, hash_context, hash_encoded, hash_item, item_key
from mmproc.media.items import AudioItem, VideoItem, VideoMetadata
from PIL import Image


def _rgb(h: int = 32, w: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _gradient() -> Image.Image:
    arr = (np.arange(6 * 5 * 3, dtype=np.uint8) * 7).reshape(6, 5, 3)
    return Image.fromarray(arr)


# Pinned values: a change here means every deployed cache key changes. Bump
# HASH_FORMAT_VERSION on purpose when the framing changes, then update these.
GOLDEN = {
    # algorithm: (image hash, context digest)
    "blake3": (
        "32e59a58fdfd9195bd989b5d795e0b4cecf8ef4b0821a5cf1602d93afd2caa69",
        "a63cff39e8d39f47ddb20b0344f1d5b7bd463685a00d3f041845bc7d6db86141",
    ),
    "xxh3": ("bf8615ec6c53a2819a7e81e9d522bd4c", "e3efad563560d4dad57ca2320ed8511d"),
}


def _reference(algorithm: str, stream: bytes) -> str:
    """The hash of a documented byte stream, computed with the hash library directly."""
    if algorithm == "xxh3":
        return xxhash.xxh3_128(stream).hexdigest()
    return blake3.blake3(stream).hexdigest()


algorithms = pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)


@pytest.mark.parametrize(("algorithm", "digits"), [("blake3", 64), ("xxh3", 32)])
def test_hash_is_hex_and_deterministic(algorithm: str, digits: int) -> None:
    image = _gradient()
    first = hash_item("image", image, algorithm)
    assert len(first) == digits
    int(first, 16)
    assert len(hash_context("A", {}, {}, algorithm)) == digits // 2
    assert len(item_key(hash_context("A", {}, {}, algorithm), first, algorithm)) == digits
    assert hash_item("image", image, algorithm) == first
    assert hash_item("image", _gradient(), algorithm) == first


@algorithms
def test_golden_values_are_stable(algorithm: str) -> None:
    image, context = GOLDEN[algorithm]
    assert hash_item("image", _gradient(), algorithm) == image
    ctx = hash_context(
        "Qwen2VLForConditionalGeneration", {"patch_size": 14}, {"fps": 2.0}, algorithm
    )
    assert ctx.hex() == context


def test_blake3_is_the_default() -> None:
    assert hash_item("image", _gradient()) == GOLDEN["blake3"][0]
    assert item_key(b"c" * 16, "ab") == item_key(b"c" * 16, "ab", "blake3")
    assert item_key(b"c" * 16, "ab") != item_key(b"c" * 16, "ab", "xxh3")


def test_an_unknown_algorithm_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'; expected one of blake3"):
        hash_item("image", _gradient(), "md5")
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        item_key(b"c" * 16, "ab", ["xxh3"])  # type: ignore[arg-type]


@algorithms
def test_image_framing_is_as_documented(algorithm: str) -> None:
    def field(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    image = _gradient()
    stream = (
        field(b"mmproc-item/1")
        + field(b"image")
        + field(b"pil")
        + field(b"RGB")
        + struct.pack("<QQ", 5, 6)
        + field(b"")  # no palette
        + field(b"")  # no transparency
        + field(b"raw")
        + image.tobytes()
        + struct.pack("<Q", 5 * 6 * 3)  # the data's length follows it
    )
    assert hash_item("image", image, algorithm) == _reference(algorithm, stream)


@algorithms
def test_encoded_framing_is_as_documented(algorithm: str) -> None:
    def field(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    stream = (
        field(b"mmproc-item/1")
        + field(b"video")
        + field(b"encoded")
        + field(b'{"fps":2}')
        + field(b"\x00\x00\x01mp4")
    )
    got = hash_encoded("video", b"\x00\x00\x01mp4", b'{"fps":2}', algorithm)
    assert got == _reference(algorithm, stream)


def test_an_encoded_items_hash_covers_its_bytes_its_recipe_and_its_modality() -> None:
    base = hash_encoded("image", b"PNG-bytes", b"pillow 12")
    assert hash_encoded("image", b"PNG-bytez", b"pillow 12") != base
    assert hash_encoded("image", b"PNG-bytes", b"pillow 13") != base
    assert hash_encoded("video", b"PNG-bytes", b"pillow 12") != base
    # Framed apart from decoded items: bytes that happen to be an array's data hash otherwise.
    pixels = np.frombuffer(b"PNG-bytes", dtype=np.uint8)
    assert hash_encoded("image", pixels.tobytes(), b"") != hash_item("image", pixels)


@algorithms
def test_array_framing_is_as_documented(algorithm: str) -> None:
    def field(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    video = np.arange(2 * 3 * 4 * 1, dtype=np.uint8).reshape(2, 3, 4, 1)
    stream = (
        field(b"mmproc-item/1")
        + field(b"video")
        + field(b"ndarray")
        + field(b"|u1")
        + struct.pack("<5Q", 4, 2, 3, 4, 1)
        + field(video.tobytes())
    )
    assert hash_item("video", video, algorithm) == _reference(algorithm, stream)


def _metadata(timestamps: tuple[float, ...] = (0.0, 0.5)) -> VideoMetadata:
    return VideoMetadata(
        fps=30.0,
        duration_s=1.0,
        total_frames=30,
        frame_indices=(0, 15),
        timestamps_s=timestamps,
        width=4,
        height=3,
    )


@algorithms
def test_video_item_framing_is_as_documented(algorithm: str) -> None:
    def field(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    frames = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(2, 3, 4, 3)
    stream = (
        field(b"mmproc-item/1")
        + field(b"video")
        + field(b"video-metadata")
        + struct.pack("<ddQ", 30.0, 1.0, 30)  # source fps, duration, frame count
        + field(struct.pack("<2q", 0, 15))  # sampled frame indices
        + field(struct.pack("<2d", 0.0, 0.5))  # and their timestamps
        + field(b"ndarray")
        + field(b"|u1")
        + struct.pack("<5Q", 4, 2, 3, 4, 3)
        + field(frames.tobytes())
    )
    item = VideoItem(frames, _metadata())
    assert hash_item("video", item, algorithm) == _reference(algorithm, stream)


def test_frames_without_metadata_hash_like_the_bare_array() -> None:
    frames = np.random.default_rng(5).integers(0, 256, (2, 3, 4, 3), dtype=np.uint8)
    assert hash_item("video", VideoItem(frames)) == hash_item("video", frames)
    assert hash_item("video", VideoItem(frames, _metadata())) != hash_item("video", frames)


def test_sampled_times_are_part_of_a_video_items_hash() -> None:
    frames = np.random.default_rng(5).integers(0, 256, (2, 3, 4, 3), dtype=np.uint8)
    same = hash_item("video", VideoItem(frames.copy(), _metadata()))
    assert hash_item("video", VideoItem(frames, _metadata())) == same
    assert hash_item("video", VideoItem(frames, _metadata((0.0, 0.6)))) != same


def test_one_pixel_changes_the_hash() -> None:
    arr = _rgb()
    changed = arr.copy()
    changed[17, 23, 1] ^= 1
    assert hash_item("image", Image.fromarray(arr)) != hash_item("image", Image.fromarray(changed))
    assert hash_item("video", arr[None]) != hash_item("video", changed[None])


def test_dtype_change_with_same_bytes_changes_the_hash() -> None:
    arr = _rgb()[None]
    assert arr.tobytes() == arr.view(np.int8).tobytes()
    assert hash_item("video", arr) != hash_item("video", arr.view(np.int8))


def test_shape_change_with_same_bytes_changes_the_hash() -> None:
    arr = _rgb()[None]
    reshaped = arr.reshape(1, 40, 32, 3)
    assert hash_item("video", arr) != hash_item("video", reshaped)
    assert hash_item("image", Image.fromarray(arr[0])) != hash_item(
        "image", Image.fromarray(reshaped[0])
    )


def test_modality_is_part_of_the_hash() -> None:
    arr = _rgb()[None]
    assert hash_item("video", arr) != hash_item("image", arr)


def test_mode_palette_and_transparency_are_part_of_the_hash() -> None:
    gray = Image.fromarray(_rgb()[:, :, 0])
    as_p = Image.frombytes("P", gray.size, gray.tobytes())
    as_p.putpalette(bytes(range(256)) * 3)
    assert gray.tobytes() == as_p.tobytes()
    assert hash_item("image", gray) != hash_item("image", as_p)

    other_palette = as_p.copy()
    other_palette.putpalette(bytes(reversed(range(256))) * 3)
    assert hash_item("image", as_p) != hash_item("image", other_palette)

    transparent = as_p.copy()
    transparent.info["transparency"] = 0
    assert hash_item("image", as_p) != hash_item("image", transparent)


def test_noncontiguous_array_hashes_like_its_copy() -> None:
    video = np.random.default_rng(3).integers(0, 256, (3, 8, 10, 3), dtype=np.uint8)
    assert hash_item("video", np.asfortranarray(video)) == hash_item("video", video)
    view = video[:, ::2]
    assert hash_item("video", view) == hash_item("video", np.ascontiguousarray(view))


def test_torch_tensor_hashes_like_numpy() -> None:
    video = np.random.default_rng(3).integers(0, 256, (3, 8, 10, 3), dtype=np.uint8)
    assert hash_item("video", torch.from_numpy(video)) == hash_item("video", video)


def test_bfloat16_tensor_is_hashable_and_distinct_from_float16() -> None:
    bits = torch.arange(64, dtype=torch.int16)
    bf16, fp16 = bits.view(torch.bfloat16), bits.view(torch.float16)
    assert hash_item("x", bf16) == hash_item("x", bf16.clone())
    assert hash_item("x", bf16) != hash_item("x", fp16)


def test_audio_sample_rate_and_samples_matter() -> None:
    wave = np.linspace(-1, 1, 1000, dtype=np.float32)
    base = hash_item("audio", AudioItem(wave, 16000))
    assert hash_item("audio", AudioItem(wave.copy(), 16000)) == base
    assert hash_item("audio", AudioItem(wave, 22050)) != base
    changed = wave.copy()
    changed[500] = 0.25
    assert hash_item("audio", AudioItem(changed, 16000)) != base
    assert hash_item("audio", wave) != base  # a bare array is not an audio item


@algorithms
def test_pil_streaming_matches_the_documented_stream(
    monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    # Rows wider than one 64 KiB chunk, and many chunks.
    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (40, 7000, 3), np.uint8))
    data = image.tobytes()
    stream = (
        struct.pack("<Q", 13) + b"mmproc-item/1"
        + struct.pack("<Q", 5) + b"image"
        + struct.pack("<Q", 3) + b"pil"
        + struct.pack("<Q", 3) + b"RGB"
        + struct.pack("<QQQQ", 7000, 40, 0, 0)
        + struct.pack("<Q", 3) + b"raw"
        + data
        + struct.pack("<Q", len(data))
    )  # fmt: skip
    expected = _reference(algorithm, stream)
    assert hash_item("image", image, algorithm) == expected
    # Without Pillow's private encoder factory, the tobytes() fallback gives the same hash.
    monkeypatch.setattr(hashing, "Image", types.SimpleNamespace(Image=Image.Image))
    assert hash_item("image", image, algorithm) == expected


@pytest.mark.parametrize("mode", ["1", "L", "LA", "RGBA", "CMYK", "I;16", "I", "F", "YCbCr"])
def test_every_pil_mode_hashes(mode: str) -> None:
    image = Image.fromarray(_rgb()).convert("RGB")
    converted = image.convert(mode) if mode != "I;16" else Image.new("I;16", image.size, 1234)
    assert hash_item("image", converted) == hash_item("image", converted.copy())


def test_unsupported_item_type() -> None:
    with pytest.raises(TypeError, match="parse mm_data first"):
        hash_item("image", b"\x89PNG")
    with pytest.raises(TypeError, match="object array"):
        hash_item("video", np.array([object()]))


def test_context_is_order_insensitive_and_value_sensitive() -> None:
    arch = "Qwen2VLForConditionalGeneration"
    a = hash_context(arch, {"min_pixels": 3136, "max_pixels": 12845056}, {"fps": 2, "x": [1, 2]})
    b = hash_context(arch, {"max_pixels": 12845056, "min_pixels": 3136}, {"x": [1, 2], "fps": 2})
    assert a == b
    assert len(a) == 32  # BLAKE3-256
    assert hash_context(arch, {"min_pixels": 3136, "max_pixels": 1}, {"fps": 2, "x": [1, 2]}) != a
    assert hash_context("Other", {"min_pixels": 3136, "max_pixels": 12845056}, {}) != hash_context(
        arch, {"min_pixels": 3136, "max_pixels": 12845056}, {}
    )
    # The same mapping as processor config or as options is not the same context.
    assert hash_context(arch, {"k": 1}, {}) != hash_context(arch, {}, {"k": 1})


def test_context_accepts_common_non_json_values() -> None:
    class Color(enum.Enum):
        RED = "red"

    ctx = {
        "np_int": np.int64(3),
        "np_float": np.float32(0.5),
        "array": np.array([0.48145466, 0.4578275]),
        "set": {"b", "a"},
        "path": Path("/models/qwen"),
        "bytes": b"\x00\x01",
        "enum": Color.RED,
        "dtype": torch.bfloat16,
    }
    assert hash_context("A", ctx, {}) == hash_context("A", dict(reversed(ctx.items())), {})
    assert hash_context("A", {"np_int": np.int64(3)}, {}) == hash_context("A", {"np_int": 3}, {})


def test_context_rejects_unstable_values() -> None:
    with pytest.raises(TypeError, match="processing context"):
        hash_context("A", {"processor": object()}, {})


def test_item_key_depends_on_both_parts() -> None:
    ctx1 = hash_context("A", {}, {})
    ctx2 = hash_context("B", {}, {})
    h1 = hash_item("image", _gradient())
    h2 = hash_item("image", Image.fromarray(_rgb()))
    keys = {item_key(ctx1, h1), item_key(ctx1, h2), item_key(ctx2, h1), item_key(ctx2, h2)}
    assert len(keys) == 4
    assert item_key(ctx1, h1) == item_key(ctx1, h1)


def test_format_version_is_exposed() -> None:
    assert hashing.HASH_FORMAT_VERSION >= 1
