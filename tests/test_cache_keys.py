"""mmproc.cache_keys: what an item's cache key covers, for each way an item can be named."""

from __future__ import annotations

import importlib

import pytest
from mmproc.cache_keys import CacheKeys
from mmproc.context import ModelContext
from mmproc.hashing import canonical_json, hash_encoded
from mmproc.inputs import decoding_recipe
from mmproc.media import AudioFormat, MediaOptions, VideoSampling

CTX = ModelContext("TinyForKeys", plugin="tests")
DATA = b"\x00\x00\x00\x18ftypmp42 not really a video"


def source_key(media: MediaOptions, modality: str, data: bytes = DATA) -> str:
    keys = CacheKeys(CTX, "blake3", media)
    return keys.source_key(keys.context_digest({}, False), modality, data)


def test_an_encoded_video_is_keyed_by_how_it_is_sampled() -> None:
    two_fps = source_key(MediaOptions(video=VideoSampling(fps=2.0)), "video")
    assert source_key(MediaOptions(video=VideoSampling(fps=2.0)), "video") == two_fps
    assert source_key(MediaOptions(video=VideoSampling(fps=1.0)), "video") != two_fps
    assert source_key(MediaOptions(video=VideoSampling(fps=2.0, max_frames=8)), "video") != two_fps


def test_encoded_audio_is_keyed_by_the_format_it_is_converted_to() -> None:
    as_is = source_key(MediaOptions(), "audio")
    assert source_key(MediaOptions(audio=AudioFormat(sample_rate=16000)), "audio") != as_is
    assert source_key(MediaOptions(audio=AudioFormat(mono=True)), "audio") != as_is


def test_an_encoded_image_is_keyed_by_its_bytes_whatever_the_video_and_audio_settings() -> None:
    plain = source_key(MediaOptions(), "image")
    other = MediaOptions(video=VideoSampling(fps=1.0), audio=AudioFormat(sample_rate=8000))
    assert source_key(other, "image") == plain
    assert source_key(MediaOptions(), "image", DATA + b"!") != plain


@pytest.mark.parametrize(
    ("modality", "module", "name", "value"),
    [
        ("image", "PIL", "__version__", "0.0.1"),
        ("image", "PIL.features", "version_codec", lambda codec: "0.0"),
        ("video", "av", "library_versions", {"libavcodec": (1, 0, 0)}),
        ("audio", "soundfile", "__libsndfile_version__", "0.0.1"),
        ("audio", "soxr", "__libsoxr_version__", "0.0.1"),
        ("video", "mmproc.inputs", "DECODING_VERSION", 0),
    ],
)
def test_what_decodes_an_encoded_item_is_part_of_its_key(
    monkeypatch: pytest.MonkeyPatch, modality: str, module: str, name: str, value: object
) -> None:
    # Another libjpeg or FFmpeg, or another sampling rule of mmproc's, may decode a file to other
    # pixels: its items must not share keys with the old one's (the engine keys its own caches,
    # which outlive a front end's restart, on them).
    before = source_key(MediaOptions(), modality)
    monkeypatch.setattr(importlib.import_module(module), name, value)
    assert source_key(MediaOptions(), modality) != before


def test_an_encoded_item_a_decoded_one_and_a_named_one_never_share_a_key() -> None:
    import numpy as np

    keys = CacheKeys(CTX, "blake3", MediaOptions())
    digest = keys.context_digest({}, False)
    pixels = np.frombuffer(DATA, dtype=np.uint8)
    by_bytes = keys.source_key(digest, "image", DATA)
    assert keys.content_key(digest, "image", pixels) != by_bytes
    # Not even a caller who names an item by the hash of those bytes gets their key.
    recipe = canonical_json(decoding_recipe("image", MediaOptions())).encode()
    assert keys.id_key(digest, "image", hash_encoded("image", DATA, recipe)) != by_bytes
    # And an image and a video named alike are two items.
    assert keys.id_key(digest, "image", "x") != keys.id_key(digest, "video", "x")
