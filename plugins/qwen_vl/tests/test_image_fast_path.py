"""The uint8 fast path against transformers' own Qwen2-VL PIL backend, loaded from a model folder.

Reference: the image processor of a Qwen2-VL folder written by ``mmproc.testing`` (real hub
settings), PIL backend, called with rescale and normalise off; its float32 ``pixel_values`` hold
whole numbers, cast to uint8 for a bit-for-bit comparison.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from mmproc.fused_norm import FusedInputNorm
from mmproc.plugin import ChannelLayout, NormSpec
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from mmproc_qwen_vl.image_fast_path import (
    QWEN2_VL_PATCH_SETTINGS,
    ImageSizeError,
    image_token_count,
    patch_settings_from_processor,
    patchify_uint8,
    smart_resize,
)
from PIL import Image
from transformers import AutoImageProcessor, AutoProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

RAW = {"do_rescale": False, "do_normalize": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_folder(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def pil_processor(folder: Path) -> Any:
    processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True, backend="pil")
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    return processor


@pytest.fixture(scope="module")
def settings(pil_processor: Any) -> dict[str, int]:
    return patch_settings_from_processor(pil_processor)


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels: every resampling weight and rounding shows up in the output."""
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    return rgba if mode == "RGBA" else rgba.convert(mode)


def reference(processor: Any, images: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    out = processor(images, **RAW, **kwargs)
    pixels = np.asarray(out["pixel_values"])
    assert pixels.dtype == np.float32
    as_uint8 = pixels.astype(np.uint8)
    assert np.array_equal(as_uint8, pixels), "raw pixel values are not whole numbers"
    return as_uint8, np.asarray(out["image_grid_thw"])


def assert_same(fast: tuple[np.ndarray, np.ndarray], ref: tuple[np.ndarray, np.ndarray]) -> None:
    pixels, grid = fast
    assert pixels.dtype == np.uint8 and pixels.flags.c_contiguous
    assert grid.dtype == np.int64
    assert np.array_equal(grid, ref[1])
    assert pixels.shape == ref[0].shape
    assert np.array_equal(pixels, ref[0])


def test_settings_read_from_the_folder_are_the_hub_settings(settings: dict[str, int]) -> None:
    assert settings == dict(QWEN2_VL_PATCH_SETTINGS)
    assert settings["min_pixels"] == 3136 and settings["max_pixels"] == 12845056
    assert settings["resample"] == Image.Resampling.BICUBIC


SIZES = [
    (1, 1),
    (2, 1),
    (1, 2),
    (10, 1000),
    (1000, 10),
    (1, 200),  # exactly the 200:1 limit
    (200, 1),
    (5, 1000),
    (28, 28),
    (27, 29),
    (56, 57),
    (100, 100),
    (224, 224),
    (333, 777),
    (640, 480),
    (1024, 768),
    (1920, 1080),
]


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_bit_identical_to_the_pil_backend(
    pil_processor: Any, settings: dict[str, int], width: int, height: int
) -> None:
    image = noise(width, height, seed=width * 7919 + height)
    assert_same(patchify_uint8(image, **settings), reference(pil_processor, image))


def test_bit_identical_on_a_large_photo_sized_image(
    pil_processor: Any, settings: dict[str, int]
) -> None:
    image = noise(4000, 3000)
    assert_same(patchify_uint8(image, **settings), reference(pil_processor, image))


@pytest.mark.parametrize(
    "mode", ["L", "LA", "RGBA", "RGBa", "P", "PA", "1", "CMYK", "YCbCr", "I", "F", "I;16"]
)
def test_bit_identical_for_every_image_mode(
    pil_processor: Any, settings: dict[str, int], mode: str
) -> None:
    image = noise(131, 97, mode)
    assert_same(patchify_uint8(image, **settings), reference(pil_processor, image))


def test_transparency_keys_are_composited_onto_white(
    pil_processor: Any, settings: dict[str, int]
) -> None:
    palette = noise(90, 60, "P")
    palette.info["transparency"] = int(np.asarray(palette)[0, 0])
    gray = noise(90, 60, "L")
    gray.info["transparency"] = int(np.asarray(gray)[0, 0])
    for image in (palette, gray):
        fast = patchify_uint8(image, **settings)
        assert_same(fast, reference(pil_processor, image))
        opaque = image.copy()
        del opaque.info["transparency"]
        assert not np.array_equal(fast[0], patchify_uint8(opaque, **settings)[0])


@pytest.mark.parametrize(
    ("width", "height", "min_pixels", "max_pixels"),
    [
        (640, 480, 3136, 224 * 224),  # shrunk: the max_pixels branch
        (4000, 30, 3136, 112 * 112),  # shrunk, short side floored at one factor
        (64, 48, 512 * 512, 12845056),  # grown: the min_pixels branch
    ],
)
def test_bit_identical_when_the_area_limits_bind(
    pil_processor: Any, width: int, height: int, min_pixels: int, max_pixels: int
) -> None:
    image = noise(width, height)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    fast = patchify_uint8(
        image,
        **{**QWEN2_VL_PATCH_SETTINGS, "min_pixels": min_pixels, "max_pixels": max_pixels},
    )
    assert_same(fast, reference(pil_processor, image, size=size))


@pytest.mark.parametrize(
    ("patch_size", "temporal_patch_size", "merge_size"), [(14, 1, 2), (16, 2, 2), (14, 3, 1)]
)
def test_bit_identical_for_other_patch_layouts(
    pil_processor: Any, patch_size: int, temporal_patch_size: int, merge_size: int
) -> None:
    image = noise(300, 200)
    layout = {
        "patch_size": patch_size,
        "temporal_patch_size": temporal_patch_size,
        "merge_size": merge_size,
    }
    fast = patchify_uint8(image, **{**QWEN2_VL_PATCH_SETTINGS, **layout})
    assert_same(fast, reference(pil_processor, image, **layout))


def test_a_batch_concatenates_like_the_processor(
    pil_processor: Any, settings: dict[str, int]
) -> None:
    images = [noise(640, 480, seed=1), noise(33, 1000, "L", seed=2), noise(1, 1, "RGBA", seed=3)]
    pixels, grid = patchify_uint8(images, **settings)
    assert_same((pixels, grid), reference(pil_processor, images))
    assert grid.shape == (3, 3)
    assert len(pixels) == int(grid.prod(axis=1).sum())


def test_same_values_as_the_float_path_after_fused_input_norm(
    pil_processor: Any, settings: dict[str, int]
) -> None:
    # What the engine sees: FusedInputNorm on the fast path's uint8 against transformers' full
    # (rescale + normalise) float32 output, within float32 rounding.
    image = noise(1024, 768)
    full = torch.from_numpy(np.asarray(pil_processor(image)["pixel_values"]))
    spec = NormSpec.from_image_processor(
        pil_processor, layout=ChannelLayout.flat_patches(patch_size=14, temporal_patch_size=2)
    )
    norm = FusedInputNorm(spec, dtype=torch.float32)
    pixels, _ = patchify_uint8(image, **settings)
    normalised = norm(torch.from_numpy(pixels))
    assert normalised.shape == full.shape
    assert float((normalised - full).abs().max()) <= 2e-6


def hf_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int] | str:
    try:
        return hf_smart_resize(height, width, 28, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError:
        return "error"


def our_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int] | str:
    try:
        return smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    except ImageSizeError:
        return "error"


def size_cases() -> Iterator[tuple[int, int]]:
    rng = np.random.default_rng(7)
    yield from [(1, 1), (1, 200), (1, 201), (14, 14), (42, 42), (70, 70), (3000, 4000)]
    yield from (tuple(int(v) for v in pair) for pair in rng.integers(1, 5000, (3000, 2)))
    yield from (tuple(int(v) for v in pair) for pair in rng.integers(1, 60, (500, 2)))


@pytest.mark.parametrize(
    ("min_pixels", "max_pixels"), [(3136, 12845056), (3136, 1003520), (147384, 2822400)]
)
def test_smart_resize_matches_transformers(min_pixels: int, max_pixels: int) -> None:
    for height, width in size_cases():
        expected = hf_size(height, width, min_pixels, max_pixels)
        assert our_size(height, width, min_pixels, max_pixels) == expected, (height, width)


@pytest.mark.parametrize(("width", "height"), [(201, 1), (1, 201), (2001, 10), (10, 4000)])
def test_aspect_ratio_beyond_200_is_a_clear_error(
    pil_processor: Any, width: int, height: int
) -> None:
    image = noise(width, height)
    with pytest.raises(ValueError):  # transformers refuses it too
        pil_processor(image, **RAW)
    with pytest.raises(ImageSizeError, match=r"aspect ratio of .*:1.* at most 200:1") as info:
        patchify_uint8(image)
    assert isinstance(info.value, ValueError)  # what transformers raises: the core names the item
    assert (info.value.width, info.value.height) == (width, height)


def test_a_bad_item_fails_the_whole_batch_with_its_index() -> None:
    with pytest.raises(TypeError, match="image 1: expected a PIL image, got ndarray"):
        patchify_uint8([noise(10, 10), np.zeros((10, 10, 3), np.uint8)])  # type: ignore[list-item]
    with pytest.raises(ImageSizeError, match=r"^image 0: .*both sides must be positive"):
        patchify_uint8(Image.new("RGB", (0, 5)))
    with pytest.raises(ImageSizeError, match=r"^image 2: image of 500x2 pixels") as info:
        patchify_uint8([noise(10, 10), noise(20, 20), noise(500, 2)])
    assert info.value.index == 2
    with pytest.raises(ValueError, match="at least one image"):
        patchify_uint8([])


@pytest.mark.parametrize(("width", "height"), [*SIZES, (4000, 3000), (5000, 4000), (30, 4000)])
def test_token_count_equals_the_grid_derived_count(
    pil_processor: Any, width: int, height: int
) -> None:
    count = image_token_count(height, width)
    patches = pil_processor.get_number_of_image_patches(height, width)
    assert count == patches // 4
    if width * height <= 1024 * 768:  # the rest is the same arithmetic; keep the test fast
        _, grid = patchify_uint8(noise(width, height))
        assert count == int(grid.prod()) // 4


def test_token_count_equals_the_placeholders_the_processor_expands(
    folder: Path, pil_processor: Any
) -> None:
    processor = AutoProcessor.from_pretrained(
        folder, local_files_only=True, image_processor=pil_processor
    )
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for width, height in [(640, 480), (10, 1000), (1, 1)]:
        prompt = "look <|vision_start|><|image_pad|><|vision_end|> at this"
        ids = processor(text=[prompt], images=[noise(width, height)])["input_ids"][0]
        assert list(ids).count(image_pad) == image_token_count(height, width)


def test_settings_refuse_a_processor_the_fast_path_cannot_mirror(pil_processor: Any) -> None:
    class NoResize:
        do_resize = False

    with pytest.raises(ValueError, match="do_resize=True"):
        patch_settings_from_processor(NoResize())

    class Torchvision:
        patch_size, temporal_patch_size, merge_size = 14, 2, 2
        size: ClassVar[dict[str, int]] = {"shortest_edge": 3136, "longest_edge": 12845056}
        resample = "InterpolationMode.NEAREST_EXACT"

    with pytest.raises(ValueError, match="not a Pillow filter"):
        patch_settings_from_processor(Torchvision())


def test_settings_from_a_full_processor_or_the_torchvision_backend(folder: Path) -> None:
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert patch_settings_from_processor(processor) == dict(QWEN2_VL_PATCH_SETTINGS)
    assert patch_settings_from_processor(processor.image_processor) == dict(QWEN2_VL_PATCH_SETTINGS)
