"""The receiving side: decoded features become model inputs on a device."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from mmproc import engine
from mmproc.engine import (
    DEFAULT_PIXEL_KEYS,
    NORM_CACHE_BYTES,
    NORM_CACHE_ENTRIES,
    norm_cache_info,
    norm_module,
    prepare_feature,
    prepare_request,
)
from mmproc.errors import DecodeError
from mmproc.fused_norm import FusedInputNorm, raw_pixel_kwargs, to_uint8_pixels
from mmproc.norm_spec import ChannelLayout, NormSpec
from PIL import Image
from transformers.image_utils import PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
QWEN2_VL = dict(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=3136,
    max_pixels=12845056,
    image_mean=list(CLIP_MEAN),
    image_std=list(CLIP_STD),
    resample=PILImageResampling.BICUBIC,
)
QWEN_LAYOUT = ChannelLayout.flat_patches(patch_size=14, temporal_patch_size=2)
SPEC = NormSpec(CLIP_MEAN, CLIP_STD, 1 / 255, QWEN_LAYOUT, ("pixel_values", "pixel_values_videos"))


def image(height: int = 100, width: int = 150) -> Image.Image:
    rng = np.random.default_rng(height * 1000 + width)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("backend", [Qwen2VLImageProcessorPil, Qwen2VLImageProcessor])
def test_uint8_feature_becomes_the_hf_float_inputs(backend) -> None:
    ip = backend(**QWEN2_VL)
    img = image()
    hf = ip(images=img, return_tensors="pt")
    raw = ip(images=img, return_tensors="pt", **raw_pixel_kwargs())
    pixels = to_uint8_pixels(raw["pixel_values"])
    assert pixels is not None
    spec = NormSpec.from_image_processor(ip, layout=QWEN_LAYOUT)
    feature = {"pixel_values": pixels, "image_grid_thw": raw["image_grid_thw"]}

    out = prepare_feature(feature, spec.to_wire(), device="cpu", dtype=torch.float32)
    torch.testing.assert_close(out["pixel_values"], hf["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(out["image_grid_thw"], hf["image_grid_thw"])
    assert out["image_grid_thw"].dtype == torch.int64

    out = prepare_feature(feature, spec.to_wire(), device="cpu")  # bfloat16 by default
    assert out["pixel_values"].dtype == torch.bfloat16
    ref = hf["pixel_values"].to(torch.bfloat16).double()
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126))) - 7)
    assert bool(((out["pixel_values"].double() - ref).abs() <= step).all())


def test_float_feature_without_spec_is_cast_to_the_model_dtype() -> None:
    pixels = torch.rand(8, 1176)
    grid = torch.tensor([[1, 2, 4]])
    feature = {"pixel_values": pixels, "image_grid_thw": grid, "second_per_grid_ts": torch.ones(1)}
    out = prepare_feature(feature, None, device="cpu", dtype=torch.bfloat16)
    assert torch.equal(out["pixel_values"], pixels.to(torch.bfloat16))
    assert out["image_grid_thw"] is grid  # already where it belongs: moved as it is
    assert out["second_per_grid_ts"].dtype == torch.float32  # not a pixel key: dtype kept
    assert DEFAULT_PIXEL_KEYS == ("pixel_values", "pixel_values_videos")


def test_video_pixels_follow_the_spec_too() -> None:
    raw = torch.randint(0, 256, (16, 1176), dtype=torch.uint8)
    out = prepare_feature(
        {"pixel_values_videos": raw, "video_grid_thw": torch.tensor([[2, 2, 4]])},
        SPEC.to_wire(),
        device="cpu",
        dtype=torch.float32,
    )
    assert torch.equal(out["pixel_values_videos"], FusedInputNorm(SPEC, dtype=torch.float32)(raw))


def test_pixel_keys_argument_overrides_the_spec() -> None:
    raw = torch.randint(0, 256, (4, 1176), dtype=torch.uint8)
    out = prepare_feature({"patches": raw}, SPEC, device="cpu", pixel_keys={"patches"})
    assert out["patches"].dtype == torch.bfloat16
    assert torch.equal(out["patches"], FusedInputNorm(SPEC)(raw))
    # a name left out of pixel_keys is moved untouched
    out = prepare_feature({"pixel_values": raw}, SPEC, device="cpu", pixel_keys=())
    assert out["pixel_values"] is raw


def test_non_tensor_values_pass_through() -> None:
    feature = {"num_frames": 3, "pixel_values": torch.rand(2, 1176)}
    out = prepare_feature(feature, None, device="cpu")
    assert out["num_frames"] == 3


def test_float_pixels_next_to_a_spec_are_refused() -> None:
    with pytest.raises(DecodeError, match=r"'pixel_values'.*uint8"):
        prepare_feature({"pixel_values": torch.rand(4, 1176)}, SPEC.to_wire(), device="cpu")


def test_pixels_that_do_not_fit_the_spec_raise_decode_error() -> None:
    with pytest.raises(DecodeError, match=r"'pixel_values'.*length 1176"):
        prepare_feature(
            {"pixel_values": torch.zeros(4, 1000, dtype=torch.uint8)}, SPEC.to_wire(), device="cpu"
        )


def test_malformed_spec_raises_decode_error() -> None:
    wire = SPEC.to_wire()
    wire["std"] = [0.5, 0.0, 0.5]
    with pytest.raises(DecodeError, match="std must be > 0"):
        prepare_feature(
            {"pixel_values": torch.zeros(1, 1176, dtype=torch.uint8)}, wire, device="cpu"
        )


def test_modules_are_cached_per_spec_device_and_dtype() -> None:
    a = norm_module(NormSpec.from_wire(SPEC.to_wire()), device="cpu")
    b = norm_module(NormSpec.from_wire(SPEC.to_wire()), device=torch.device("cpu"))
    assert a is b
    assert not a.training
    assert norm_module(SPEC, device="cpu", dtype=torch.float32) is not a
    other = NormSpec((0.5,) * 3, (0.5,) * 3, 1 / 255, QWEN_LAYOUT)
    assert norm_module(other, device="cpu") is not a


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_from_pinned_memory() -> None:
    raw = torch.randint(0, 256, (64, 1176), dtype=torch.uint8).pin_memory()
    grid = torch.tensor([[1, 8, 8]])
    feature = {"pixel_values": raw, "image_grid_thw": grid}
    out = prepare_feature(feature, SPEC.to_wire(), device="cuda")
    assert out["pixel_values"].device.type == "cuda"
    assert out["image_grid_thw"].device.type == "cuda"
    expected = FusedInputNorm(SPEC)(raw)
    assert torch.equal(out["pixel_values"].cpu(), expected)


def test_public_names() -> None:
    assert engine.__all__ == sorted(engine.__all__)
    for name in engine.__all__:
        if name != "DEFAULT_PIXEL_KEYS":
            assert getattr(engine, name).__doc__


def test_prepare_request_normalises_every_feature_and_names_a_bad_one() -> None:
    from types import SimpleNamespace

    spec = NormSpec(
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        rescale=1 / 255,
        layout=ChannelLayout.channels_first(),
    )
    raw = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    good = SimpleNamespace(
        modality="image", item_index=0, data={"pixel_values": raw}, norm=spec.to_wire()
    )
    request = SimpleNamespace(request_id="r1", features=[good])
    (inputs,) = prepare_request(request, device="cpu", dtype=torch.float32)
    expected = (raw.float() / 255 - 0.5) / 0.5
    assert torch.allclose(inputs["pixel_values"], expected, atol=1e-6)
    bad = SimpleNamespace(
        modality="image", item_index=1, data={"pixel_values": raw.float()}, norm=spec.to_wire()
    )
    with pytest.raises(DecodeError, match=r"request 'r1', feature 1 \(image item 1\)"):
        prepare_request(SimpleNamespace(request_id="r1", features=[good, bad]), device="cpu")


def test_uint8_pixels_without_a_norm_spec_are_refused() -> None:
    raw = torch.zeros(4, 1176, dtype=torch.uint8)
    with pytest.raises(
        DecodeError, match="'pixel_values' holds uint8 pixels but the feature has no norm spec"
    ):
        prepare_feature({"pixel_values": raw}, None, device="cpu")
    # other uint8 outputs (not pixels) are moved as they are
    out = prepare_feature({"mask": raw}, None, device="cpu")
    assert out["mask"].dtype == torch.uint8


# --- norm specs come from the message: nothing is built from one before it is checked ---------


def hostile_request(layout: dict, pixels: torch.Tensor | None = None) -> list[Any]:
    """A request of a few hundred bytes, as the wire carries it, whose norm spec asks for
    ``layout``."""
    from mmproc.wire import EngineRequest, WireFeature, encode_request

    pixels = torch.zeros(1, 3, dtype=torch.uint8) if pixels is None else pixels
    norm = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "rescale": 1 / 255, "layout": layout}
    feature = WireFeature("image", 0, "h", 0, 1, None, {"pixel_values": pixels}, norm)
    return encode_request(EngineRequest("hostile", [1], [feature]))


@pytest.mark.parametrize(
    ("layout", "field"),
    [
        ({"axis": -1, "block": 20_000_000}, "layout.block must be <= 1048576"),
        ({"axis": -1, "block": 2**62}, "layout.block must be <= 1048576"),
        ({"axis": -1, "block": 2**40}, "layout.block must be <= 1048576"),
        ({"axis": -1, "tiles": 2**62, "block": 2**62}, "layout.block must be <= 1048576"),
        ({"axis": -1, "block": 2**19}, "layout.tiles * channels * layout.block"),
        ({"axis": -(2**63)}, "layout.axis must be >= -32"),
    ],
)
def test_a_hostile_norm_spec_is_a_decode_error_and_builds_nothing(layout: dict, field: str) -> None:
    from mmproc.wire import decode_request

    frames = hostile_request(layout)
    assert sum(len(frame) for frame in frames) < 400
    before = norm_cache_info()
    request = decode_request(frames)
    with pytest.raises(DecodeError) as info:
        prepare_request(request, device="cpu")
    assert field in str(info.value) and "request 'hostile', feature 0" in str(info.value)
    assert norm_cache_info() == before


def test_a_spec_that_does_not_fit_its_pixels_builds_and_caches_no_module() -> None:
    from mmproc.wire import decode_request

    # Within every bound, but not the pixels' layout: refused before a module exists.
    request = decode_request(hostile_request({"axis": -1, "block": 300_000}))
    before = norm_cache_info()
    with pytest.raises(DecodeError, match=r"'pixel_values': norm spec: .* length 900000"):
        prepare_request(request, device="cpu")
    assert norm_cache_info() == before


def test_the_module_cache_is_bounded_in_bytes() -> None:
    # Specs whose buffers take 6 MiB each, with pixels that fit them: more than the cache holds.
    block = (3 << 20) // 12
    pixels = torch.zeros(1, 3 * block, dtype=torch.uint8)
    for index in range(8):
        spec = NormSpec((0.5,) * 3, (0.5,) * 3, 1 / (255 + index), ChannelLayout(-1, block))
        prepare_feature({"pixel_values": pixels}, spec, device="cpu")
        assert norm_cache_info().nbytes <= NORM_CACHE_BYTES
    assert norm_cache_info().entries <= NORM_CACHE_ENTRIES
    # the most recent one is still cached
    assert norm_module(spec, device="cpu") is norm_module(spec, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_hostile_spec_allocates_nothing_on_the_gpu() -> None:
    from mmproc.wire import decode_request

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for layout in ({"axis": -1, "block": 20_000_000}, {"axis": -1, "block": 300_000}):
        request = decode_request(hostile_request(layout))
        with pytest.raises(DecodeError, match="norm spec"):
            prepare_request(request, device="cuda")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
