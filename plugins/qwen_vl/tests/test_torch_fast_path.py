"""The uint8 fast path for transformers' torchvision backend on the CPU is bit-identical to it.

The reference is ``Qwen2VLImageProcessor`` (transformers' torchvision backend) loaded from a
folder with Qwen2-VL's real settings (patch 14, merge 2, temporal patch 2, min_pixels 3136,
max_pixels 12845056, CLIP mean / std, bicubic), called as mmproc calls it for device
normalisation: ``do_rescale=False, do_normalize=False, device="cpu"``. Its ``pixel_values`` are
uint8 already; ours must equal them (and ``image_grid_thw``) bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.plugin import BatchedField, FlatField, ProcessingMode
from mmproc.testing.conformance import assert_matches_hf
from mmproc_qwen_vl import shared as qwen_shared
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from mmproc_qwen_vl.image_fast_path import ImageSizeError
from mmproc_qwen_vl.model import IMAGE_PLACEHOLDER, QwenVLModel
from mmproc_qwen_vl.torch_fast_path import (
    is_torchvision_backend,
    patchify_uint8_torch,
    torch_patch_settings,
)
from PIL import Image
from transformers import AutoProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

IMAGE = IMAGE_PLACEHOLDER
RAW = {"do_rescale": False, "do_normalize": False}

# (width, height): tiny, thin, the 200:1 limit both ways, odd, exactly on the grid (no resize),
# upscaled to min_pixels, and large.
SIZES = [
    (1, 1),
    (10, 1000),
    (1000, 10),
    (200, 1),
    (1, 200),
    (400, 2),
    (333, 17),
    (57, 91),
    (56, 56),
    (28, 28),
    (641, 479),
    (2000, 1500),
]
# Every mode a loaded image may have, plus palette / grey images with a transparency key.
MODES = [
    "RGB",
    "L",
    "LA",
    "RGBA",
    "RGBa",
    "RGBX",
    "P",
    "PA",
    "P+transparency",
    "L+transparency",
    "1",
    "CMYK",
    "YCbCr",
    "HSV",
    "LAB",
    "I",
    "I;16",
    "F",
]


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels in ``mode`` (every resampling weight shows in the output)."""
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P+transparency":  # a palette image whose index 3 is transparent, as GIFs have
        image = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        return image
    if mode == "L+transparency":
        image = rgba.convert("L")
        image.info["transparency"] = 128
        return image
    if mode == "PA":
        return rgba.convert("P").convert("PA")
    return rgba if mode == "RGBA" else rgba.convert(mode)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_folder(tmp_path_factory.mktemp("qwen2_vl_tv") / "hub")


@pytest.fixture(scope="module")
def image_processor(folder: Path) -> Qwen2VLImageProcessor:
    ip = Qwen2VLImageProcessor.from_pretrained(folder, local_files_only=True)
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 2)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (3136, 12845056)
    assert int(ip.resample) == int(Image.Resampling.BICUBIC)
    return ip


def hf_raw(ip: Qwen2VLImageProcessor, images: list[Any]) -> Any:
    """transformers' torchvision backend as mmproc calls it with device normalisation on."""
    return ip(images, device="cpu", return_tensors="pt", **RAW)


def assert_same(ip: Qwen2VLImageProcessor, images: list[Any], context: Any = "") -> None:
    ref = hf_raw(ip, images)
    pixels, grids = patchify_uint8_torch(images, **torch_patch_settings(ip))
    assert ref["pixel_values"].dtype == torch.uint8, context  # raw kwargs: uint8 from transformers
    assert pixels.dtype == torch.uint8 and pixels.is_contiguous(), context
    assert grids.dtype == torch.int64 and ref["image_grid_thw"].dtype == torch.int64, context
    assert torch.equal(grids, ref["image_grid_thw"]), context
    assert torch.equal(pixels, ref["pixel_values"]), context


@pytest.mark.parametrize(("width", "height"), SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_bit_identical_per_size(image_processor, width: int, height: int) -> None:
    assert_same(image_processor, [noise(width, height, seed=width * 7 + height)], (width, height))


@pytest.mark.parametrize("mode", MODES)
def test_bit_identical_per_mode(image_processor, mode: str) -> None:
    # Resized down, exactly on the grid (transformers' resize is a no-op), and 1x1 (a converted
    # image whose pixels numpy sees as contiguous in any order).
    images = [noise(97, 61, mode, seed=1), noise(56, 84, mode, seed=2), noise(1, 1, mode, seed=3)]
    assert images[0].mode == mode.split("+")[0]
    assert_same(image_processor, images, mode)


def test_bit_identical_batches(image_processor) -> None:
    """Mixed sizes and modes, repeated shapes (transformers stacks those into one resize)."""
    images = [
        noise(640, 480, seed=10),
        noise(33, 44, "RGBA", seed=11),
        noise(640, 480, seed=12),
        noise(200, 1, "L", seed=13),
        noise(33, 44, "P+transparency", seed=14),
        noise(640, 480, "CMYK", seed=15),
        noise(1, 1, seed=16),
    ]
    assert_same(image_processor, images)
    assert_same(image_processor, [noise(300, 200, seed=s) for s in range(5)])  # one group of 5


def test_arrays_as_mmproc_passes_them(image_processor) -> None:
    """mmproc turns uint8 arrays and tensors into PIL images (L, RGB, RGBA) before the plugin."""
    from mmproc.inputs import parse_mm_data

    rng = np.random.default_rng(20)
    raw = [
        rng.integers(0, 256, (45, 67), dtype=np.uint8),
        rng.integers(0, 256, (45, 67, 1), dtype=np.uint8),
        rng.integers(0, 256, (45, 67, 3), dtype=np.uint8),
        rng.integers(0, 256, (45, 67, 4), dtype=np.uint8),
        torch.randint(0, 256, (3, 45, 67), dtype=torch.uint8),
        torch.randint(0, 256, (45, 67, 4), dtype=torch.uint8),
        torch.randint(0, 256, (45, 67), dtype=torch.uint8),
    ]
    parsed = parse_mm_data({"image": raw})
    images = parsed["image"]
    assert all(isinstance(image, Image.Image) for image in images)
    assert_same(image_processor, images)
    # (H, W, 1) and (H, W, 3) arrays given to transformers directly come out the same too
    # (transformers refuses 2-D arrays; RGBA ones it composites in float, differently).
    for array in raw[1:3]:
        assert torch.equal(
            hf_raw(image_processor, [array])["pixel_values"],
            hf_raw(image_processor, [Image.fromarray(array.squeeze())])["pixel_values"],
        )


@pytest.mark.parametrize(
    ("resample", "temporal", "merge"),
    [(0, 2, 2), (1, 2, 2), (2, 2, 2), (3, 1, 2), (3, 3, 1), (2, 1, 1)],
)
def test_other_settings(resample: int, temporal: int, merge: int) -> None:
    ip = Qwen2VLImageProcessor(
        min_pixels=3136,
        max_pixels=200_000,
        resample=resample,
        temporal_patch_size=temporal,
        merge_size=merge,
    )
    images = [noise(700, 500, seed=30), noise(31, 97, "RGBA", seed=31)]
    assert_same(ip, images, (resample, temporal, merge))


def test_settings_refused() -> None:
    for kwargs in ({"do_resize": False}, {"do_convert_rgb": False}, {"resample": 4}):
        with pytest.raises(ValueError):
            torch_patch_settings(Qwen2VLImageProcessor(**kwargs))
    settings = torch_patch_settings(Qwen2VLImageProcessor())
    assert settings["interpolation"].value == "bicubic"


def test_errors() -> None:
    with pytest.raises(ImageSizeError, match=r"^image 1: .*aspect ratio") as info:
        patchify_uint8_torch([noise(10, 10), noise(201, 1)])
    assert info.value.index == 1
    with pytest.raises(TypeError, match="image 0: expected a PIL image"):
        patchify_uint8_torch([np.zeros((4, 4, 3), np.uint8)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        patchify_uint8_torch([])


# --- through mmproc ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor(folder: Path) -> Iterator[mmproc.Processor]:
    with mmproc.get_processor(folder, backend="torchvision") as proc:
        assert is_torchvision_backend(proc.hf_processor.image_processor)
        yield proc


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    """transformers' processor on the same folder, built without the plugin."""
    ip = Qwen2VLImageProcessor.from_pretrained(folder, local_files_only=True)
    return AutoProcessor.from_pretrained(folder, local_files_only=True, image_processor=ip)


def test_mmproc_takes_the_path(processor, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = qwen_shared.patchify_uint8_torch

    def spy(images: Any, **settings: Any) -> Any:
        calls.append(len(images))
        return original(images, **settings)

    monkeypatch.setattr(qwen_shared, "patchify_uint8_torch", spy)
    rng = np.random.default_rng(40)
    images = [
        noise(1, 1, seed=41),
        noise(90, 60, "RGBA", seed=42),
        noise(200, 1, "P+transparency", seed=43),
        noise(640, 480, "L", seed=44),
        noise(640, 480, seed=45),
    ]
    inputs = [*images, rng.integers(0, 256, (30, 50, 4), dtype=np.uint8)]
    prompt = f"look {IMAGE}{IMAGE} and {IMAGE}{IMAGE}{IMAGE}{IMAGE}"
    out = processor.process(prompt, {"image": inputs})
    assert calls == [len(inputs)]
    # mmproc hands transformers (and the plugin) the array as a PIL image.
    hf_inputs = [*images, Image.fromarray(inputs[-1])]
    raw = reference(text=[prompt], images=hf_inputs, return_tensors="pt", device="cpu", **RAW)
    pixels = torch.cat([f.data["pixel_values"] for f in out.features])
    assert pixels.dtype == torch.uint8
    assert torch.equal(pixels, raw["pixel_values"])
    grids = torch.stack(
        [torch.as_tensor(f.data["image_grid_thw"]).reshape(3) for f in out.features]
    )
    assert torch.equal(grids, raw["image_grid_thw"])
    assert out.prompt_token_ids == raw["input_ids"][0].tolist()
    full = reference(text=[prompt], images=hf_inputs, return_tensors="pt")
    pads = {"image": reference.tokenizer.convert_tokens_to_ids("<|image_pad|>")}
    fields = {
        "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
        "image_grid_thw": BatchedField("image"),
    }
    assert_matches_hf(out, full, fields=fields, placeholder_token_ids=pads, normalised=True)


def test_taken_only_when_the_mode_asks_for_raw_media_alone_on_the_cpu(
    folder: Path, reference
) -> None:
    model = QwenVLModel()
    hf = reference
    images = [noise(33, 44, seed=50)]
    mm = {"image": images}
    raw = ProcessingMode(media_only=True, raw_pixels=True, device="cpu")
    assert model.process_mm_data(raw, mm, hf) is not None
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        assert model.process_mm_data(replace(raw, device=device), mm, hf) is None
    assert model.process_mm_data(replace(raw, raw_pixels=False), mm, hf) is None
    assert model.process_mm_data(replace(raw, media_only=False), mm, hf) is None
    # Caller kwargs the native path would not honour: transformers runs.
    caller = replace(raw, user_kwargs={"max_pixels": 10_000})
    assert model.process_mm_data(caller, mm, hf) is None
    video = {**mm, "video": [np.zeros((2, 28, 28, 3), np.uint8)]}
    assert model.process_mm_data(raw, video, hf) is None
    with mmproc.get_processor(folder, backend="torchvision", device_normalize=False) as proc:
        original = qwen_shared.patchify_uint8_torch
        try:
            qwen_shared.patchify_uint8_torch = None  # type: ignore[assignment]  # must not be used
            out = proc.process(IMAGE, {"image": images})
        finally:
            qwen_shared.patchify_uint8_torch = original
        assert out.features[0].data["pixel_values"].dtype == torch.float32
