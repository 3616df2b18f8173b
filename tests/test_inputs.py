"""mmproc.inputs: every accepted form of a media item, and every way an item can be bad."""

from __future__ import annotations

import base64
import io
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mmproc.errors import ConfigurationError, MediaItemError
from mmproc.hashing import hash_item
from mmproc.inputs import parse_mm_data, read_mm_data
from mmproc.media.items import AudioItem, VideoItem
from PIL import Image


def _rgb(h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _encode(image: Image.Image | np.ndarray, fmt: str = "PNG", **kw: Any) -> bytes:
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _one(mm_data: dict[str, Any], modality: str = "image") -> Any:
    parsed = parse_mm_data(mm_data)
    assert len(parsed[modality]) == 1
    return parsed[modality][0]


def _error(mm_data: Any, **kw: Any) -> MediaItemError:
    with pytest.raises(MediaItemError) as info:
        parse_mm_data(mm_data, **kw)
    return info.value


# --- images: every form gives the same pixels and hash ------------------------------------------


def test_every_image_form_gives_same_pixels_and_hash(tmp_path: Path) -> None:
    arr = _rgb()
    png = _encode(arr)
    path = tmp_path / "img.png"
    path.write_bytes(png)
    forms = {
        "pil": Image.fromarray(arr),
        "numpy": arr,
        "numpy_noncontiguous": np.asfortranarray(arr),
        "torch_hwc": torch.from_numpy(arr.copy()),
        "torch_chw": torch.from_numpy(arr.copy()).permute(2, 0, 1),
        "bytes": png,
        "bytearray": bytearray(png),
        "memoryview": memoryview(png),
        "data_url": _data_url(png),
        "str_path": str(path),
        "pathlike": path,
        "lazy_pil": Image.open(io.BytesIO(png)),
    }
    hashes = set()
    for name, form in forms.items():
        image = _one({"image": form})
        assert isinstance(image, Image.Image), name
        assert image.mode == "RGB", name
        assert image.size == (64, 48), name
        assert np.array_equal(np.asarray(image), arr), name
        hashes.add(hash_item("image", image))
    assert len(hashes) == 1


def test_jpeg_bytes_decode_like_pillow() -> None:
    jpeg = _encode(_rgb(), "JPEG", quality=80)
    image = _one({"image": jpeg})
    assert image.format == "JPEG"
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(jpeg))))


@pytest.mark.parametrize(
    ("image", "mode"),
    [
        (Image.fromarray(_rgb()).convert("L"), "L"),
        (Image.fromarray(_rgb()).convert("RGBA"), "RGBA"),
        (Image.fromarray(_rgb()).convert("P"), "P"),
    ],
)
def test_encoded_images_keep_their_mode(image: Image.Image, mode: str) -> None:
    parsed = _one({"image": _encode(image, "PNG")})
    assert parsed.mode == mode
    assert parsed.tobytes() == image.tobytes()


def test_arrays_map_channels_to_modes() -> None:
    gray = _rgb()[:, :, 0]
    assert _one({"image": gray}).mode == "L"
    assert _one({"image": gray[:, :, None]}).mode == "L"
    rgba = np.concatenate([_rgb(), _rgb(seed=1)[:, :, :1]], axis=2)
    assert _one({"image": rgba}).mode == "RGBA"
    assert np.array_equal(np.asarray(_one({"image": gray})), gray)


def test_single_item_or_list() -> None:
    arr = _rgb()
    assert len(parse_mm_data({"image": arr})["image"]) == 1
    assert len(parse_mm_data({"image": [arr, arr, arr]})["image"]) == 3
    assert len(parse_mm_data({"image": (arr, arr)})["image"]) == 2


def test_empty_and_none() -> None:
    assert parse_mm_data(None) == {}
    assert parse_mm_data({}) == {}
    assert parse_mm_data({"image": None, "video": []}) == {}


def test_output_follows_modality_order() -> None:
    audio = (np.zeros(160, np.float32), 16000)
    parsed = parse_mm_data({"audio": audio, "image": _rgb()})
    assert list(parsed) == ["image", "audio"]


def test_mm_data_that_is_not_a_mapping_is_a_media_item_error() -> None:
    err = _error([_rgb()])  # type: ignore[arg-type]
    assert (err.modality, err.index) == ("mm_data", None)
    assert str(err) == (
        "mm_data must be a mapping of modality to items, such as {'image': [...]}, not list"
    )


def test_media_options_must_be_media_options() -> None:
    with pytest.raises(ConfigurationError, match="media must be a MediaOptions or None, not dict"):
        parse_mm_data({"image": _rgb()}, media={"allowed_paths": []})  # type: ignore[arg-type]


def test_unknown_modality_names_the_key() -> None:
    err = _error({"images": [_rgb()]})
    assert err.modality == "images"
    assert err.index is None
    assert str(err).startswith("unknown modality 'images'")
    assert "unknown modality" in str(err)
    assert "did you mean 'image'" in str(err)


# --- images: bad items ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF"])
def test_truncated_bytes_are_rejected(fmt: str) -> None:
    data = _encode(_rgb(), fmt)
    err = _error({"image": [_rgb(), data[: len(data) // 2]]})
    assert (err.modality, err.index) == ("image", 1)
    assert "truncated" in err.reason
    assert str(err).startswith("image item 1: ")


def test_truncated_lazy_pil_image_is_rejected() -> None:
    data = _encode(_rgb(), "PNG")
    lazy = Image.open(io.BytesIO(data[: len(data) // 2]))  # header only, pixels not read yet
    err = _error({"image": lazy})
    assert err.index == 0
    assert "truncated" in err.reason


def test_garbage_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "garbage.png"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    err = _error({"image": [str(path)]})
    assert (err.modality, err.index) == ("image", 0)
    assert "cannot identify" in err.reason


def test_empty_bytes_are_rejected() -> None:
    assert "empty" in _error({"image": b""}).reason


def test_disallowed_format_is_rejected_unless_allowed() -> None:
    pcx = _encode(_rgb(), "PCX")
    err = _error({"image": pcx})
    assert "cannot identify" in err.reason
    assert "allowed formats" in err.reason
    image = parse_mm_data({"image": pcx}, image_formats=None)["image"][0]
    assert np.array_equal(np.asarray(image), _rgb())


def test_decompression_bomb_over_twice_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    png = _encode(_rgb(48, 64))  # 3072 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow raises over 2x the limit
    err = _error({"image": [png]})
    assert (err.modality, err.index) == ("image", 0)
    assert "decompression bomb" in err.reason


def test_decompression_bomb_between_limit_and_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    png = _encode(_rgb(48, 64))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # Pillow only warns up to 2x
    with pytest.warns(Image.DecompressionBombWarning):
        err = _error({"image": png})
    assert "decompression bomb" in err.reason


def test_decompression_bomb_warning_as_error(monkeypatch: pytest.MonkeyPatch) -> None:
    png = _encode(_rgb(48, 64))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    with warnings.catch_warnings():  # as under `python -W error`: Pillow raises the warning
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        err = _error({"image": png})
    assert "decompression bomb" in err.reason


@pytest.mark.parametrize(
    "form",
    [
        lambda a: a,
        lambda a: torch.from_numpy(a),
        lambda a: Image.fromarray(a),
    ],
    ids=["numpy", "torch", "pil"],
)
def test_pixel_limit_applies_to_decoded_inputs(monkeypatch: pytest.MonkeyPatch, form: Any) -> None:
    item = form(_rgb(48, 64))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3071)
    err = _error({"image": item})
    assert "MAX_IMAGE_PIXELS" in err.reason
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3072)  # exactly at the limit is fine
    assert _one({"image": item}).size == (64, 48)


@pytest.mark.parametrize(
    ("array", "needle"),
    [
        (_rgb().astype(np.float32), "uint8"),
        (_rgb() > 0, "uint8"),
        (_rgb()[:, :, :2], "(H, W, C)"),
        (np.ascontiguousarray(_rgb().transpose(2, 0, 1)), "channels-first"),
        (np.zeros((0, 4, 3), np.uint8), "empty"),
        (np.zeros((2, 2, 2, 3), np.uint8), "(H, W, C)"),
    ],
    ids=["float", "bool", "two-channels", "chw-numpy", "empty", "4d"],
)
def test_bad_arrays(array: np.ndarray, needle: str) -> None:
    err = _error({"image": [array]})
    assert needle in err.reason


def test_bad_tensor_dtype() -> None:
    err = _error({"image": torch.zeros(3, 8, 8, dtype=torch.float32)})
    assert "uint8" in err.reason


def test_data_url_errors() -> None:
    png = _encode(_rgb())
    b64 = base64.b64encode(png).decode()
    assert "image/*" in _error({"image": f"data:text/plain;base64,{b64}"}).reason
    assert "base64" in _error({"image": f"data:image/png,{b64}"}).reason
    assert "invalid base64" in _error({"image": "data:image/png;base64,@@@@"}).reason
    assert "malformed" in _error({"image": "data:image/png;base64"}).reason


def test_http_urls_are_refused_unless_fetching_is_enabled() -> None:
    err = _error({"image": ["https://example.com/cat.png"]})
    assert err.reason.startswith("https:// URLs are not fetched")
    assert "MediaOptions.remote" in err.reason


def test_other_url_schemes_are_not_supported() -> None:
    for url in ["ftp://example.com/cat.png", "file:///etc/passwd"]:
        assert "URLs are not supported" in _error({"image": url}).reason


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert "no such file" in _error({"image": str(tmp_path / "nope.png")}).reason
    assert "directory" in _error({"image": tmp_path}).reason


def test_unsupported_type() -> None:
    assert "unsupported image type" in _error({"image": 42}).reason


# --- the IO pool ----------------------------------------------------------------------------------


class _CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0
        self.threads: set[int] = set()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1

        def run() -> Any:
            self.threads.add(threading.get_ident())
            return fn(*args, **kwargs)

        return super().submit(run)


def test_decoding_runs_on_the_io_pool_for_several_items() -> None:
    png = _encode(_rgb())
    with _CountingPool() as pool:
        parsed = parse_mm_data({"image": [png, png, _rgb()]}, io_pool=pool)
        # The two encoded items, each opened (header) and then decoded; the array stays inline.
        assert pool.submitted == 4
        assert threading.get_ident() not in pool.threads
        assert [np.array_equal(np.asarray(i), _rgb()) for i in parsed["image"]] == [True] * 3
        parse_mm_data({"image": png}, io_pool=pool)
        assert pool.submitted == 4  # a single item is decoded inline


def test_first_bad_item_in_order_is_reported_with_a_pool() -> None:
    png = _encode(_rgb())
    truncated = png[: len(png) // 2]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            assert _error({"image": [png, truncated, png, truncated]}, io_pool=pool).index == 1
            assert _error({"image": [png, b"junk", png, b"junk"]}, io_pool=pool).index == 1
        err = _error({"image": [png, png], "video": [[png, truncated]]}, io_pool=pool)
        assert (err.modality, err.index) == ("video", 0)


def test_an_item_that_cannot_be_opened_is_reported_before_one_that_fails_to_decode() -> None:
    # Items are opened (headers read, sizes added up) before any is decoded.
    png = _encode(_rgb())
    err = _error({"image": [png[: len(png) // 2], b"junk"]})
    assert err.index == 1
    assert "cannot identify" in err.reason


# --- video ----------------------------------------------------------------------------------------


def _video(t: int = 4, h: int = 16, w: int = 24) -> np.ndarray:
    return np.random.default_rng(2).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def test_video_array_passes_through_without_copy() -> None:
    video = _video()
    item = _one({"video": video}, "video")
    assert isinstance(item, VideoItem)
    assert item.frames is video
    assert item.metadata is None


def test_a_video_item_passes_through() -> None:
    item = VideoItem(_video())
    assert _one({"video": item}, "video") is item
    assert [v is item for v in parse_mm_data({"video": [item, item]})["video"]] == [True, True]


def test_every_video_form_gives_the_same_array(tmp_path: Path) -> None:
    video = _video()
    frames_png = [_encode(f) for f in video]
    path = tmp_path / "f0.png"
    path.write_bytes(frames_png[0])
    forms = {
        "pil_frames": [Image.fromarray(f) for f in video],
        "array_frames": list(video),
        "tuple_of_frames": tuple(Image.fromarray(f) for f in video),
        "torch_thwc": torch.from_numpy(video.copy()),
        "torch_tchw": torch.from_numpy(video.copy()).permute(0, 3, 1, 2),
        "nested_encoded": [[path, *frames_png[1:]]],
        "non_contiguous": np.asfortranarray(video),
    }
    hashes = set()
    for name, form in forms.items():
        parsed = _one({"video": form}, "video")
        assert parsed.metadata is None, name
        assert parsed.frames.dtype == np.uint8, name
        assert parsed.frames.flags.c_contiguous, name
        assert np.array_equal(parsed.frames, video), name
        hashes.add(hash_item("video", parsed))
    assert hashes == {hash_item("video", video)}


def test_list_of_videos() -> None:
    video = _video()
    parsed = parse_mm_data({"video": [video, [Image.fromarray(f) for f in video]]})
    assert len(parsed["video"]) == 2


def test_palette_frames_become_rgb() -> None:
    frame = Image.fromarray(_rgb(16, 24)).convert("P")
    parsed = _one({"video": [frame, frame]}, "video").frames
    assert parsed.shape == (2, 16, 24, 3)
    assert np.array_equal(parsed[0], np.asarray(frame.convert("RGB")))


def test_gray_frames_keep_one_channel() -> None:
    frame = Image.fromarray(_rgb(16, 24)).convert("L")
    assert _one({"video": [frame]}, "video").frames.shape == (1, 16, 24, 1)


@pytest.mark.parametrize(
    ("video", "needle"),
    [
        ([[]], "no frames"),
        (_video().astype(np.float32), "uint8"),
        (np.zeros((4, 8, 8), np.uint8), "(T, H, W, C)"),
        (np.zeros((0, 8, 8, 3), np.uint8), "empty"),
        ([[Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))]], "frame 1"),
        (b"\x00\x00\x00\x18ftypmp42", "cannot open it"),
        ("clip.mp4", "no such file"),
        (42, "unsupported video type"),
        (VideoItem(_video().astype(np.float32)), "uint8"),
        (VideoItem(np.zeros((4, 8, 8, 3), np.uint8), "fps=30"), "VideoMetadata"),  # type: ignore[arg-type]
    ],
    ids=["no-frames", "float", "3d", "empty", "mismatch", "bytes", "path", "int", "item", "meta"],
)
def test_bad_videos(video: Any, needle: str) -> None:
    err = _error({"video": video})
    assert err.modality == "video"
    assert err.index == 0
    assert needle in err.reason


def test_bad_encoded_frame_names_the_frame() -> None:
    png = _encode(_rgb())
    err = _error({"video": [[png, png, png[:100]]]})
    assert err.reason.startswith("frame 2: ")


def test_video_frame_pixel_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    assert "MAX_IMAGE_PIXELS" in _error({"video": _video()}).reason


# --- audio ---------------------------------------------------------------------------------------


def test_audio_forms() -> None:
    wave = np.sin(np.linspace(0, 100, 16000)).astype(np.float32)
    forms = [
        (wave, 16000),
        [wave, 16000],
        AudioItem(wave, 16000),
        {"array": wave, "sampling_rate": 16000},
        (wave.astype(np.float64), 16000.0),
        (torch.from_numpy(wave), np.int64(16000)),
        (wave.tolist(), 16000),
    ]
    hashes = set()
    for form in forms:
        item = _one({"audio": form}, "audio")
        assert isinstance(item, AudioItem)
        assert item.waveform.dtype == np.float32
        assert item.sample_rate == 16000
        assert type(item.sample_rate) is int
        assert item.duration_s == pytest.approx(1.0)
        hashes.add(hash_item("audio", item))
    assert len(hashes) == 1


def test_float32_audio_is_not_copied() -> None:
    wave = np.zeros(100, np.float32)
    assert _one({"audio": (wave, 8000)}, "audio").waveform is wave


def test_list_of_audio_items_and_stereo() -> None:
    mono = (np.zeros(100, np.float32), 8000)
    stereo = (np.zeros((2, 100), np.float32), 8000)
    parsed = parse_mm_data({"audio": [mono, stereo]})
    assert [a.waveform.shape for a in parsed["audio"]] == [(100,), (2, 100)]


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        ((np.zeros(0, np.float32), 16000), "empty audio"),
        ((np.zeros(10, np.int16), 16000), "integer PCM"),
        ((np.zeros(10, np.complex64), 16000), "floating point"),
        ((np.zeros((100, 2), np.float32), 16000), "(channels, samples)"),
        ((np.zeros((1, 2, 3), np.float32), 16000), "shape"),
        ((np.array([0.0, np.nan], np.float32), 16000), "NaN"),
        ((np.zeros(10, np.float32), 0), "positive integer"),
        ((np.zeros(10, np.float32), 22050.5), "positive integer"),
        ((np.zeros(10, np.float32), True), "must be a number"),
        ({"array": np.zeros(10, np.float32)}, "sampling_rate"),
        ("speech.wav", "no such file"),
        (object(), "unsupported audio type"),
        (("speech.wav", 16000), "numpy array"),
    ],
)
def test_bad_audio(item: Any, needle: str) -> None:
    err = _error({"audio": [(np.zeros(10, np.float32), 8000), item]})
    assert (err.modality, err.index) == ("audio", 1)
    assert needle in err.reason


# --- reading and decoding apart (read_mm_data) ----------------------------------------------------


def test_read_items_say_which_were_given_encoded_and_decode_only_those_asked_for() -> None:
    arr = _rgb(seed=5)
    png = _encode(arr)
    with read_mm_data({"image": [Image.fromarray(arr), png, _data_url(png)]}) as read:
        assert read.counts == {"image": 3}
        assert read.refs() == [("image", 0), ("image", 1), ("image", 2)]
        assert [read.source(ref) for ref in read.refs()] == [None, png, png]
        first = read.decode([("image", 0), ("image", 1)])
        assert set(first) == {("image", 0), ("image", 1)}
        assert np.array_equal(np.asarray(first["image", 1]), arr)
        every = read.decode_all()["image"]
        assert every[1] is first["image", 1]  # decoded once
        assert np.array_equal(np.asarray(every[2]), arr)


def test_an_item_that_fails_to_decode_is_named_when_it_is_decoded() -> None:
    truncated = _encode(_rgb(seed=6))[:300]
    with read_mm_data({"image": [_rgb(), truncated]}) as read:  # the header reads fine
        read.decode([("image", 0)])
        with pytest.raises(MediaItemError, match="image item 1: corrupt or truncated PNG"):
            read.decode_all()


def test_read_items_refuse_to_decode_once_closed(tmp_path: Path) -> None:
    import soundfile

    path = tmp_path / "clip.wav"
    soundfile.write(path, np.zeros(800, np.float32), 8000)
    with read_mm_data({"audio": [str(path)]}) as read:
        assert read.source(("audio", 0)) == path.read_bytes()
    with pytest.raises(RuntimeError, match="closed"):
        read.decode_all()


def test_the_request_size_limit_counts_encoded_items_once_they_are_to_be_decoded() -> None:
    from mmproc.media import MediaLimits, MediaOptions

    arr = _rgb(100, 100)
    media = MediaOptions(limits=MediaLimits(max_request_decoded_bytes=2 * arr.nbytes))
    mm_data = {"image": [arr, _encode(arr), _encode(arr, "BMP")]}
    # An encoded item the cache answers is never decoded, so it weighs nothing.
    with read_mm_data(mm_data, media=media) as read:
        assert len(read.decode([("image", 0), ("image", 1)])) == 2
        with pytest.raises(MediaItemError, match=r"image item 2: .*max_request_decoded_bytes"):
            read.decode_all()
    err = _error(mm_data, media=media)
    assert (err.index, "max_request_decoded_bytes" in err.reason) == (2, True)


def test_a_bad_header_is_found_only_when_its_item_is_to_be_decoded() -> None:
    with read_mm_data({"image": [_rgb(), b"not an image at all"]}) as read:
        assert read.source(("image", 1)) == b"not an image at all"
        read.decode([("image", 0)])
        with pytest.raises(MediaItemError, match="image item 1: cannot identify the image data"):
            read.decode_all()


def test_an_encoded_image_gets_its_exif_orientation_and_a_decoded_one_is_taken_as_it_is() -> None:
    # Orientation 6: the camera was turned; a viewer shows the picture rotated 90 degrees.
    stored = Image.fromarray(_rgb(h=40, w=30, seed=9))
    exif = stored.getexif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, "PNG", exif=exif)
    [shown] = parse_mm_data({"image": [buffer.getvalue()]})["image"]
    assert shown.size == (40, 30)  # (width, height): turned
    assert np.array_equal(
        np.asarray(shown), np.asarray(stored.transpose(Image.Transpose.ROTATE_270))
    )
    [as_given] = parse_mm_data({"image": [stored]})["image"]
    assert as_given.size == (30, 40)
