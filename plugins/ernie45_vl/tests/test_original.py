"""The original layout, reimplemented: token counts, placeholder ranges, pixel rows, video stamps
and token types against an independent computation of Baidu's processor rules written here (there
is no reference processor to call: it is remote code, never run), and the folder's settings read
as that processor reads them."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.inputs import parse_mm_data
from mmproc.media import VideoSampling
from mmproc.plugin import ConfigurationError, MediaItemError, ProcessorLoadError
from mmproc.testing import noise_image
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_ernie45_vl.demo import ORIGINAL_PREPROCESSOR, write_original_folder
from mmproc_ernie45_vl.original import IMAGE_MARKER, VIDEO_MARKER, smart_resize, timestamp_text
from PIL import Image, ImageDraw, ImageFont

IMAGE_LIMITS = (4 * 28 * 28, 6177 * 28 * 28)
VIDEO_LIMITS = (299 * 28 * 28, 1196 * 28 * 28)
MEAN = ORIGINAL_PREPROCESSOR["image_mean"]
STD = ORIGINAL_PREPROCESSOR["image_std"]


# --- the original processor's rules, computed independently -----------------------------------


def rule_size(height: int, width: int, limits: tuple[int, int]) -> tuple[int, int]:
    """Baidu's smart resize, step by step: clamp a ratio over 200, round both sides to 28 (at
    least 28), then scale into the pixel limits."""
    low, high = limits
    if max(height, width) > 200 * min(height, width):
        short = max(28, round(min(height, width) / 28) * 28)
        long = math.floor(short * 200 / 28) * 28
        height, width = (long, short) if height > width else (short, long)
    h, w = max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)
    if h * w > high:
        scale = math.sqrt(height * width / high)
        h, w = math.floor(height / scale / 28) * 28, math.floor(width / scale / 28) * 28
    elif h * w < low:
        scale = math.sqrt(low / (height * width))
        h, w = math.ceil(height * scale / 28) * 28, math.ceil(width * scale / 28) * 28
    assert low <= h * w <= high
    return h, w


def rule_rows(pixels: np.ndarray) -> np.ndarray:
    """Patch rows of one (H, W, 3) uint8 picture, cut one patch at a time: 2 x 2 blocks of 14 x 14
    patches in reading order, the patches of a block in reading order; a row holds the R plane,
    then G, then B."""
    rows = []
    for block_y in range(pixels.shape[0] // 28):
        for block_x in range(pixels.shape[1] // 28):
            for y in (0, 1):
                for x in (0, 1):
                    top, left = (2 * block_y + y) * 14, (2 * block_x + x) * 14
                    patch = pixels[top : top + 14, left : left + 14]
                    rows.append(np.concatenate([patch[:, :, c].ravel() for c in range(3)]))
    return np.stack(rows)


def rule_time(seconds: float) -> str:
    hours, rest = divmod(seconds, 3600)
    minutes, rest = divmod(rest, 60)
    return f"time: {int(hours):02d}:{int(minutes):02d}:{rest:05.2f}"


def rule_video_rows(
    frames: np.ndarray, times: Sequence[float], font_file: Path
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Each frame stamped with its time at its own size (black text, white outline, top left, a
    font a tenth of the shorter side), an odd count padded with the last stamped frame, then
    resized like an image within the video limits and cut into rows."""
    pictures = []
    for frame, seconds in zip(frames, times, strict=True):
        picture = Image.fromarray(frame).convert("RGB")
        size = int(min(picture.size) * 0.1)
        font = ImageFont.truetype(str(font_file), size)
        ImageDraw.Draw(picture).text(
            (0, 0),
            rule_time(seconds),
            font=font,
            fill=(0, 0, 0),
            stroke_width=int(size * 0.1),
            stroke_fill=(255, 255, 255),
        )
        pictures.append(picture)
    if len(pictures) % 2:
        pictures.append(pictures[-1].copy())
    h, w = rule_size(frames.shape[1], frames.shape[2], VIDEO_LIMITS)
    resized = [np.asarray(p.resize((w, h), Image.Resampling.BICUBIC)) for p in pictures]
    return np.concatenate([rule_rows(r) for r in resized]), (len(pictures), h // 14, w // 14)


def rule_image_rows(image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``convert("RGB")`` (an alpha band dropped, not composited), bicubic resize, rows."""
    rgb = image.convert("RGB")
    h, w = rule_size(rgb.height, rgb.width, IMAGE_LIMITS)
    resized = np.asarray(rgb.resize((w, h), Image.Resampling.BICUBIC))
    return rule_rows(resized), (1, h // 14, w // 14)


# --- helpers --------------------------------------------------------------------------------


def token(processor: mmproc.Processor, text: str) -> int:
    return int(processor.hf_processor.tokenizer.convert_tokens_to_ids(text))


def check_range(
    out: mmproc.ProcessedInputs, feature: Any, start: str, end: str, count: int, original: Any
) -> None:
    """The item's range is start, ``count`` x <|IMAGE_PLACEHOLDER|> (embedded), end."""
    r = feature.placeholder
    ids = out.prompt_token_ids[r.offset : r.end]
    patch = token(original, "<|IMAGE_PLACEHOLDER|>")
    assert ids == [token(original, start), *[patch] * count, token(original, end)]
    assert r.embed_mask() == (False, *[True] * count, False)


# --- sizes and tokens -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "image", "video"),
    [
        ((1000, 1500), (1008, 1512), (784, 1176)),
        ((100, 150), (112, 140), (420, 616)),
        ((20, 20), (56, 56), (504, 504)),
        ((28, 4000), (28, 4004), (56, 5796)),
        ((10, 3000), (28, 5600), (56, 6860)),
        ((4000, 3000), (2520, 1904), (1092, 812)),
        ((1080, 1920), (1092, 1932), (700, 1288)),
        ((3000, 3000), (2184, 2184), (952, 952)),
    ],
)
def test_sizes_follow_the_original_smart_resize(
    size: tuple[int, int], image: tuple[int, int], video: tuple[int, int]
) -> None:
    # (height, width) -> resized, with the image and with the video limits: worked by hand from
    # Baidu's rule (the ratio-300 row is clamped to 200:1, where transformers refuses it).
    for limits, want in ((IMAGE_LIMITS, image), (VIDEO_LIMITS, video)):
        low, high = limits
        assert smart_resize(*size, factor=28, min_pixels=low, max_pixels=high) == want
        assert rule_size(*size, limits) == want


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P+transparency", "LA", "CMYK"])
def test_images_expand_and_cut_as_the_original_processor_does(
    original: mmproc.Processor, mode: str
) -> None:
    # (width, height): tiny, odd, wide, on the grid, beyond 200:1 (clamped).
    sizes = [(20, 20), (150, 100), (333, 77), (56, 84), (3000, 10)]
    images = [noise_image(w, h, mode, seed=i) for i, (w, h) in enumerate(sizes)]
    prompt = "<|begin_of_sentence|>User: " + "".join(
        f"Picture {i + 1}:{IMAGE_MARKER}" for i in range(len(images))
    )
    out = original.process(prompt, {"image": images})
    assert [f.modality for f in out.features] == ["image"] * len(images)
    for feature, image in zip(out.features, images, strict=True):
        rows, grid = rule_image_rows(image)
        _, gh, gw = grid
        assert feature.data["image_grid_thw"].tolist() == list(grid)
        check_range(out, feature, "<|IMAGE_START|>", "<|IMAGE_END|>", gh * gw // 4, original)
        pixels = feature.data["pixel_values"]
        assert pixels.dtype == torch.uint8 and np.array_equal(pixels.numpy(), rows)
    assert out.features[-1].data["image_grid_thw"].tolist() == [1, 2, 400]  # 200 tokens


def test_an_alpha_band_is_dropped_not_composited(original: mmproc.Processor) -> None:
    rgba = Image.new("RGBA", (56, 56), (200, 10, 10, 0))  # fully transparent red
    (feature,) = original.process(IMAGE_MARKER, {"image": [rgba]}).features
    # The hidden colour stays: the original converts with Image.convert("RGB").
    assert feature.data["pixel_values"][0, :196].unique().tolist() == [200]


# --- video ----------------------------------------------------------------------------------


def test_timestamps_read_as_the_original_writes_them() -> None:
    table = {
        0: "time: 00:00:00.00",
        1.5: "time: 00:00:01.50",
        3725.25: "time: 01:02:05.25",
        10 / 3: "time: 00:00:03.33",
        59.999: "time: 00:00:60.00",
    }
    for seconds, text in table.items():
        assert timestamp_text(seconds) == rule_time(seconds) == text


@pytest.mark.parametrize("count", [1, 3, 4])
def test_video_frames_are_stamped_padded_and_cut_as_the_original_processor_does(
    original: mmproc.Processor, original_folder: Path, make_frames: Any, count: int
) -> None:
    video = make_frames(count, 64, 48, seed=count)
    out = original.process(f"Video 1:{VIDEO_MARKER}What happens?", {"video": [video]})
    (feature,) = out.features
    # Frames given as an array are taken as the model's own samples: 2 per second.
    font = original_folder / "Roboto-Regular.ttf"
    rows, grid = rule_video_rows(video, [k / 2 for k in range(count)], font)
    frames, gh, gw = grid
    assert frames == count + count % 2
    assert feature.data["video_grid_thw"].tolist() == list(grid)
    assert np.array_equal(feature.data["pixel_values_videos"].numpy(), rows)
    check_range(out, feature, "<|VIDEO_START|>", "<|VIDEO_END|>", frames * gh * gw // 8, original)
    if count > 1:  # each frame shows its own time
        same_time, _ = rule_video_rows(video, [0.0] * count, font)
        assert not np.array_equal(rows, same_time)


def test_a_video_file_is_sampled_at_2_fps_and_stamped_with_each_frames_time(
    original: mmproc.Processor, original_folder: Path, tmp_path: Path
) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(encode_video(numbered_frames(105), fps=10))  # 10.5 s
    assert original.media.video == VideoSampling(
        fps=2, min_frames=16, max_frames=180, frame_multiple=1
    )
    (item,) = parse_mm_data({"video": [str(path)]}, media=original.media)["video"]
    assert item.num_frames == 21 and item.metadata is not None
    (feature,) = original.process(VIDEO_MARKER, {"video": [str(path)]}).features
    font = original_folder / "Roboto-Regular.ttf"
    rows, grid = rule_video_rows(item.frames, item.metadata.timestamps_s, font)
    assert grid[0] == 22  # 21 frames, the last one twice
    assert feature.data["video_grid_thw"].tolist() == list(grid)
    assert np.array_equal(feature.data["pixel_values_videos"].numpy(), rows)


def test_processing_a_video_leaves_its_frames_as_they_were(
    original_folder: Path, make_frames: Any
) -> None:
    # The stamps land on copies: an item's frames are the caller's array and the cache's.
    video = make_frames(3, 64, 48, seed=7)
    before = video.copy()
    with mmproc.get_processor(original_folder, cache_bytes=0) as processor:
        first, again = (processor.process(VIDEO_MARKER, {"video": [video]}) for _ in range(2))
    assert np.array_equal(video, before)
    key = "pixel_values_videos"
    assert torch.equal(first.features[0].data[key], again.features[0].data[key])


def test_frames_too_small_to_stamp_are_refused(
    original: mmproc.Processor, make_frames: Any
) -> None:
    with pytest.raises(MediaItemError, match=r"video item 0: .*too small to stamp"):
        original.process(VIDEO_MARKER, {"video": [make_frames(2, 9, 40)]})


# --- prompt outputs and pixels --------------------------------------------------------------


def test_token_types_are_baidus_on_both_paths_and_from_the_cache(
    original_folder: Path, make_frames: Any
) -> None:
    image, video = noise_image(150, 100, seed=3), make_frames(3, 80, 60, seed=4)
    prompt = f"a {VIDEO_MARKER} b {IMAGE_MARKER} c <|IMAGE_START|>"
    for expansion in (False, True):
        with mmproc.get_processor(original_folder, hf_prompt_expansion=expansion) as processor:
            for _ in range(2):  # a miss, then every item from the cache
                out = processor.process(prompt, {"image": [image], "video": [video]})
                types = out.prompt_outputs["token_type_ids"].tolist()
                video_range, image_range = (f.placeholder for f in out.features)
                want = [0] * len(out.prompt_token_ids)
                want[image_range.offset : image_range.end] = [1] * image_range.length
                want[video_range.offset : video_range.end] = [1, *[2] * (video_range.length - 2), 1]
                assert types == want
                assert out.prompt_token_ids[-1] == token(processor, "<|IMAGE_START|>")
                assert types[-1] == 0  # outside any item: text, as Baidu's processor counts it


def test_pixels_travel_as_uint8_normalised_by_the_folders_settings(
    original: mmproc.Processor, original_folder: Path
) -> None:
    spec = original.norm_spec
    assert spec is not None and spec.pixel_keys == ("pixel_values", "pixel_values_videos")
    assert spec.mean == tuple(MEAN) and spec.std == tuple(STD) and spec.rescale == 1 / 255
    image = noise_image(90, 60, seed=5)
    raw = original.process(IMAGE_MARKER, {"image": [image]}).features[0].data["pixel_values"]
    with mmproc.get_processor(original_folder, device_normalize=False) as floats:
        normalised = floats.process(IMAGE_MARKER, {"image": [image]}).features[0].data
    mean = np.repeat(np.array(MEAN, dtype=np.float32), 196)
    std = np.repeat(np.array(STD, dtype=np.float32), 196)
    want = (raw.numpy().astype(np.float32) / 255 - mean) / std
    assert normalised["pixel_values"].dtype == torch.float32
    assert np.allclose(normalised["pixel_values"].numpy(), want, atol=1e-6)


def test_a_direct_call_needs_one_item_per_marker(original: mmproc.Processor) -> None:
    with pytest.raises(ValueError, match=r"2 image markers .* but 1 images were given"):
        original.hf_processor(text=[IMAGE_MARKER * 2], images=[noise_image(28, 28)])


# --- the folder -----------------------------------------------------------------------------


def test_the_folders_python_files_are_never_run(tmp_path: Path) -> None:
    folder = write_original_folder(tmp_path / "model")
    ran = tmp_path / "ran"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    modules = {entry.split(".")[0] for entry in config["auto_map"]["AutoTokenizer"] if entry}
    modules |= {
        v.split(".")[0]
        for v in json.loads((folder / "config.json").read_text())["auto_map"].values()
    }
    modules |= {v.split(".")[0] for v in ORIGINAL_PREPROCESSOR["auto_map"].values()}
    for module in modules:
        (folder / f"{module}.py").write_text(f"open({str(ran)!r}, 'w').write({module!r})\n")
    with mmproc.get_processor(folder) as processor:
        processor.process(IMAGE_MARKER, {"image": [noise_image(56, 56)]})
    assert len(modules) == 5 and not ran.exists()


def test_the_processors_own_settings_are_read_from_the_folder(
    original_folder: Path, tmp_path: Path
) -> None:
    image = noise_image(1500, 1000, seed=6)
    with mmproc.get_processor(original_folder) as processor:
        assert processor.process(IMAGE_MARKER, {"image": [image]}).features[0].data[
            "image_grid_thw"
        ].tolist() == [1, 72, 108]
    small = shutil.copytree(original_folder, tmp_path / "small")
    settings = json.loads((small / "processor_config.json").read_text())
    settings.update(image_max_pixels=28 * 28 * 16, video_fps=1, video_min_frames=4)
    (small / "processor_config.json").write_text(json.dumps(settings))
    with mmproc.get_processor(small) as processor:
        out = processor.process(IMAGE_MARKER, {"image": [image]})
        assert out.features[0].data["image_grid_thw"].tolist() == [1, 6, 8]
        assert processor.media.video == VideoSampling(fps=1, min_frames=4, max_frames=180)
    with mmproc.get_processor(
        original_folder, hf_processor_kwargs={"image_max_pixels": 28 * 28 * 16}
    ) as processor:
        out = processor.process(IMAGE_MARKER, {"image": [image]})
        assert out.features[0].data["image_grid_thw"].tolist() == [1, 6, 8]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"backend": "torchvision"}, ConfigurationError, "resizes with Pillow"),
        ({"hf_processor_kwargs": {"max_pixel": 5}}, ConfigurationError, r"\['max_pixel'\] are not"),
    ],
)
def test_options_the_original_processor_has_not_are_refused(
    original_folder: Path, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        mmproc.get_processor(original_folder, **options)


def test_a_folder_without_its_font_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = write_original_folder(tmp_path / "model", font=False)
    with pytest.raises(ProcessorLoadError, match=r"has no Roboto-Regular\.ttf, the font"):
        mmproc.get_processor(folder)


def test_a_sentencepiece_only_folder_says_what_reading_it_needs(
    original_folder: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(original_folder, tmp_path / "spm")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"\x0a\x00")
    with pytest.raises(ProcessorLoadError, match=r"tokenizer\.model .*sentencepiece"):
        mmproc.get_processor(folder)


def test_config_ids_that_disagree_with_the_tokenizer_are_refused(
    original_folder: Path, tmp_path: Path
) -> None:
    odd = shutil.copytree(original_folder, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    config["im_patch_id"] += 1
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ProcessorLoadError, match=r"im_patch_id is \d+, but .*<\|IMAGE_PLACEHOLDER"):
        mmproc.get_processor(odd)
