"""Device-side normalisation: NormSpec, FusedInputNorm, and exactness against HF's float path."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mmproc import fused_norm
from mmproc.errors import ConfigurationError, DecodeError
from mmproc.fused_norm import FusedInputNorm, raw_pixel_kwargs, to_uint8_pixels
from mmproc.norm_spec import MAX_AXIS_LENGTH, MAX_CHANNELS, ChannelLayout, NormSpec
from PIL import Image
from transformers.image_utils import PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Qwen2-VL's preprocessor_config.json settings
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
BACKENDS = {"pil": Qwen2VLImageProcessorPil, "torchvision": Qwen2VLImageProcessor}
# (height, width); 28x28 is below min_pixels (upscaled), 333x517 is no multiple of 28
SIZES = [(28, 28), (224, 300), (480, 640), (333, 517)]
QWEN_LAYOUT = ChannelLayout.flat_patches(patch_size=14, temporal_patch_size=2)


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def image_processor(request: pytest.FixtureRequest):
    return BACKENDS[request.param](**QWEN2_VL)


def make_image(height: int, width: int, seed: int = 0) -> Image.Image:
    # a gradient plus noise: smooth areas and sharp edges, and values at both ends of the range
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    noise = rng.normal(0, 60, size=(height, width, 3))
    return Image.fromarray(np.clip(ramp + noise, 0, 255).astype(np.uint8), "RGB")


def exact_values(raw: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    """``(x * rescale - mean) / std`` in float64, per value of the Qwen2-VL patch layout."""
    c = spec.num_channels
    x = raw.to(torch.float64).view(raw.shape[0], c, -1)
    mean = torch.tensor(spec.mean, dtype=torch.float64).view(1, c, 1)
    std = torch.tensor(spec.std, dtype=torch.float64).view(1, c, 1)
    return ((x * spec.rescale - mean) / std).view(raw.shape)


def bf16_step(values: torch.Tensor) -> torch.Tensor:
    """The distance between adjacent bfloat16 numbers at each value's magnitude."""
    mag = values.abs().to(torch.float64).clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def assert_bf16_close(ours: torch.Tensor, reference_f32: torch.Tensor) -> None:
    assert ours.dtype == torch.bfloat16
    ref = reference_f32.to(torch.bfloat16).to(torch.float64)
    diff = (ours.to(torch.float64) - ref).abs()
    assert bool((diff <= bf16_step(ref)).all()), f"max bf16 difference {diff.max().item()}"


# --- exactness against the HF float path -----------------------------------------------------


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_matches_hf_float_pixel_values(image_processor, height: int, width: int) -> None:
    image = make_image(height, width)
    hf = image_processor(images=image, return_tensors="pt")
    raw = image_processor(images=image, return_tensors="pt", **raw_pixel_kwargs())
    assert torch.equal(raw["image_grid_thw"], hf["image_grid_thw"])

    pixels = to_uint8_pixels(raw["pixel_values"])
    assert pixels is not None, "raw Qwen2-VL pixels must be whole numbers in [0, 255]"
    assert pixels.dtype == torch.uint8
    assert pixels.shape == hf["pixel_values"].shape
    assert pixels.nbytes * 4 == hf["pixel_values"].nbytes

    spec = NormSpec.from_image_processor(image_processor, layout=QWEN_LAYOUT)
    ours = FusedInputNorm(spec, dtype=torch.float32)(pixels)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf["pixel_values"], rtol=0, atol=1e-6)
    # both stay within float32 rounding of the exact value
    exact = exact_values(pixels, spec)
    assert (ours.double() - exact).abs().max().item() < 1e-6
    assert (hf["pixel_values"].double() - exact).abs().max().item() < 1e-6

    assert_bf16_close(FusedInputNorm(spec)(pixels), hf["pixel_values"])


def test_matches_hf_for_several_images_in_one_call(image_processor) -> None:
    images = [make_image(224, 300, seed=1), make_image(333, 517, seed=2), make_image(28, 28)]
    hf = image_processor(images=images, return_tensors="pt")["pixel_values"]
    raw = image_processor(images=images, return_tensors="pt", **raw_pixel_kwargs())
    pixels = to_uint8_pixels(raw["pixel_values"])
    assert pixels is not None
    spec = NormSpec.from_image_processor(image_processor, layout=QWEN_LAYOUT)
    torch.testing.assert_close(
        FusedInputNorm(spec, dtype=torch.float32)(pixels), hf, rtol=0, atol=1e-6
    )


def test_every_pixel_value_matches_hf_arithmetic() -> None:
    """All 256 values in every channel, through each backend's own rescale and normalise code.

    The output depends only on (channel, value), so this covers every image those backends can
    produce once resizing is done.
    """
    values = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    values = values.contiguous()
    tv = Qwen2VLImageProcessor(**QWEN2_VL)
    pil = Qwen2VLImageProcessorPil(**QWEN2_VL)
    # torchvision backend: (x - mean/rescale) / (std/rescale), constants in float32
    hf_tv = tv.rescale_and_normalize(
        values.clone(), True, tv.rescale_factor, True, CLIP_MEAN, CLIP_STD
    )
    # PIL backend: float64 rescale, rounded to float32, then (x - mean) / std in float32
    hf_pil = torch.from_numpy(
        pil.normalize(pil.rescale(values[0].numpy(), pil.rescale_factor), CLIP_MEAN, CLIP_STD)
    )[None]
    spec = NormSpec.from_image_processor(tv, layout=ChannelLayout.channels_first())
    ours = FusedInputNorm(spec, dtype=torch.float32)(values)

    r = Fraction(spec.rescale)
    exact = torch.tensor(
        [
            [float((Fraction(v) * r - Fraction(m)) / Fraction(s)) for v in range(256)]
            for m, s in zip(CLIP_MEAN, CLIP_STD, strict=True)
        ],
        dtype=torch.float64,
    ).view(1, 3, 16, 16)
    for result in (ours, hf_tv, hf_pil):
        assert result.dtype == torch.float32
        assert (result.double() - exact).abs().max().item() < 5e-7
        torch.testing.assert_close(ours, result, rtol=0, atol=1e-6)
    # the issue allows one bfloat16 step; with CLIP's constants not one of the 768 values differs
    bf16 = FusedInputNorm(spec)(values)
    assert torch.equal(bf16, hf_tv.to(torch.bfloat16))
    assert torch.equal(bf16, hf_pil.to(torch.bfloat16))


# --- FusedInputNorm --------------------------------------------------------------------------


def reference_three_step(
    x: torch.Tensor, spec: NormSpec, channel_view: tuple[int, ...]
) -> torch.Tensor:
    mean = torch.tensor(spec.mean, dtype=torch.float64).view(channel_view)
    std = torch.tensor(spec.std, dtype=torch.float64).view(channel_view)
    return (x.to(torch.float64) * spec.rescale - mean) / std


@pytest.mark.parametrize(
    ("layout", "shape", "channel_view"),
    [
        (ChannelLayout.channels_first(), (2, 3, 5, 7), (3, 1, 1)),
        (ChannelLayout.channels_first(), (3, 5, 7), (3, 1, 1)),  # no batch dimension
        (ChannelLayout.channels_first(), (2, 4, 3, 5, 7), (3, 1, 1)),  # (N, T, C, H, W)
        (ChannelLayout.channels_last(), (2, 5, 7, 3), (3,)),
    ],
)
def test_layouts_apply_each_channel_to_its_values(layout, shape, channel_view) -> None:
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=layout)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ours = FusedInputNorm(spec, dtype=torch.float32)(x)
    expected = reference_three_step(x, spec, channel_view)
    assert ours.shape == x.shape
    assert (ours.double() - expected).abs().max().item() < 1e-6


def test_flat_patch_layouts_block_and_tiles() -> None:
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    x = torch.randint(0, 256, (10, 3 * 2 * 14 * 14), dtype=torch.uint8)
    ours = FusedInputNorm(spec, dtype=torch.float32)(x)
    # channel outermost: each row is 3 blocks of T*P*P values
    expected = reference_three_step(x.view(10, 3, -1), spec, (3, 1)).view(10, -1)
    assert (ours.double() - expected).abs().max().item() < 1e-6

    # channel innermost: each row is P*P tiles of the 3 channels
    tiles = ChannelLayout(axis=-1, tiles=14 * 14)
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=tiles)
    x = torch.randint(0, 256, (10, 14 * 14 * 3), dtype=torch.uint8)
    ours = FusedInputNorm(spec, dtype=torch.float32)(x)
    expected = reference_three_step(x.view(10, -1, 3), spec, (3,)).view(10, -1)
    assert (ours.double() - expected).abs().max().item() < 1e-6


def test_float_input_gives_the_same_values_and_is_not_modified() -> None:
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    norm = FusedInputNorm(spec, dtype=torch.float32)
    x = torch.randint(0, 256, (4, 1176), dtype=torch.uint8)
    as_float = x.to(torch.float32)
    kept = as_float.clone()
    assert torch.equal(norm(as_float), norm(x))
    assert torch.equal(as_float, kept)
    assert torch.equal(norm(x.to(torch.float16)), norm(x))


def test_default_output_dtype_is_bfloat16_and_others_can_be_asked_for() -> None:
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    x = torch.randint(0, 256, (4, 1176), dtype=torch.uint8)
    assert FusedInputNorm(spec)(x).dtype == torch.bfloat16
    f32 = FusedInputNorm(spec, dtype=torch.float32)(x)
    half = FusedInputNorm(spec, dtype=torch.float16)(x)
    assert half.dtype == torch.float16
    assert torch.equal(half, f32.to(torch.float16))
    with pytest.raises(ConfigurationError, match="float dtype"):
        FusedInputNorm(spec, dtype=torch.int32)


def test_weight_and_bias_are_laid_out_once_as_buffers() -> None:
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    norm = FusedInputNorm(spec)
    assert norm.weight.shape == (1176,) and norm.weight.dtype == torch.float32
    assert list(norm.parameters()) == []
    assert norm.state_dict() == {}
    block = 2 * 14 * 14
    for c in range(3):
        w = norm.weight[c * block : (c + 1) * block]
        b = norm.bias[c * block : (c + 1) * block]
        assert bool((w == w[0]).all()) and bool((b == b[0]).all())
        assert w[0].item() == np.float32((1 / 255) / CLIP_STD[c])
        assert b[0].item() == np.float32(-CLIP_MEAN[c] / CLIP_STD[c])
    nchw = FusedInputNorm(NormSpec(CLIP_MEAN, CLIP_STD, 1 / 255, ChannelLayout.channels_first()))
    assert nchw.weight.shape == (3, 1, 1)


def test_identity_spec_only_casts() -> None:
    spec = NormSpec(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), rescale=1.0, layout=QWEN_LAYOUT)
    assert spec.is_identity
    x = torch.arange(256, dtype=torch.uint8).repeat(5)[:1176].expand(3, 1176)
    out = FusedInputNorm(spec)(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x.to(torch.bfloat16))  # 0..255 are exact in bfloat16
    as_float = x.to(torch.float32)
    assert FusedInputNorm(spec, dtype=torch.float32)(as_float) is as_float
    assert not NormSpec(CLIP_MEAN, CLIP_STD, 1 / 255, QWEN_LAYOUT).is_identity
    assert not NormSpec((0.0,) * 3, (1.0,) * 3, 1 / 255, QWEN_LAYOUT).is_identity


def test_large_batch() -> None:
    # more rows than CUDA's 65535 grid limit in y, and than any batch a model would see
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    tile = torch.randint(0, 256, (7, 1176), dtype=torch.uint8)
    rows = 70_007
    x = tile.repeat(rows // 7, 1)
    out = FusedInputNorm(spec)(x)
    assert out.shape == (rows, 1176) and out.dtype == torch.bfloat16
    expected = FusedInputNorm(spec)(tile)
    assert torch.equal(out.view(-1, 7, 1176), expected.expand(rows // 7, 7, 1176))


def test_input_that_does_not_fit_the_spec_is_refused() -> None:
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    norm = FusedInputNorm(spec)
    with pytest.raises(ConfigurationError, match="length 1176"):
        norm(torch.zeros(4, 1175, dtype=torch.uint8))
    with pytest.raises(ConfigurationError, match="length 3"):
        FusedInputNorm(NormSpec(CLIP_MEAN, CLIP_STD, 1.0, ChannelLayout.channels_first()))(
            torch.zeros(2, 4, 5, dtype=torch.uint8)
        )
    with pytest.raises(ConfigurationError, match="uint8 or float"):
        norm(torch.zeros(4, 1176, dtype=torch.int64))


@pytest.mark.parametrize("in_dtype", [torch.uint8, torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_accelerator_path_shapes_and_dtypes_on_the_meta_device(in_dtype, out_dtype) -> None:
    # the single-kernel path every non-CPU device takes, checked without a GPU
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    norm = FusedInputNorm(spec, dtype=out_dtype, device="meta")
    out = norm(torch.empty(70_007, 1176, dtype=in_dtype, device="meta"))
    assert out.shape == (70_007, 1176) and out.dtype == out_dtype and out.device.type == "meta"
    spec = NormSpec(CLIP_MEAN, CLIP_STD, 1 / 255, ChannelLayout.channels_first())
    out = FusedInputNorm(spec, device="meta")(
        torch.empty(2, 4, 3, 7, 9, dtype=in_dtype, device="meta")
    )
    assert out.shape == (2, 4, 3, 7, 9) and out.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    spec = NormSpec(mean=CLIP_MEAN, std=CLIP_STD, rescale=1 / 255, layout=QWEN_LAYOUT)
    x = torch.randint(0, 256, (1000, 1176), dtype=torch.uint8)
    cpu = FusedInputNorm(spec, dtype=torch.float32)(x)
    cuda = FusedInputNorm(spec, dtype=torch.float32, device="cuda")(x.cuda())
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=1e-6)


# --- to_uint8_pixels and raw_pixel_kwargs ----------------------------------------------------


def test_whole_numbers_become_uint8() -> None:
    values = torch.arange(256, dtype=torch.float32).view(16, 16)
    out = to_uint8_pixels(values)
    assert out is not None and out.dtype == torch.uint8
    assert torch.equal(out.to(torch.float32), values)
    assert torch.equal(to_uint8_pixels(values.numpy()), out)
    assert torch.equal(to_uint8_pixels(values.to(torch.int64)), out)
    u8 = out.clone()
    assert to_uint8_pixels(u8) is u8
    assert torch.equal(to_uint8_pixels(values.to(torch.bfloat16)), out)  # no numpy bfloat16
    assert torch.equal(to_uint8_pixels(values.to(torch.float16)), out)
    # a non-contiguous array keeps its logical layout
    transposed = to_uint8_pixels(values.numpy().T)
    assert transposed is not None and torch.equal(transposed, out.T)
    assert to_uint8_pixels(torch.tensor(7.0)).shape == ()
    empty = to_uint8_pixels(torch.zeros(0, 1176))
    assert empty is not None and empty.dtype == torch.uint8 and empty.shape == (0, 1176)


@pytest.mark.parametrize("bad", [0.5, 254.999, -1.0, 256.0, 1e9, math.nan, math.inf, -math.inf])
def test_anything_else_is_not_uint8(bad: float) -> None:
    values = torch.arange(256, dtype=torch.float32)
    values[100] = bad
    assert to_uint8_pixels(values) is None
    assert to_uint8_pixels(values.to(torch.float64)) is None
    if bad != 254.999:  # bfloat16 has no 254.999: it rounds to 255
        assert to_uint8_pixels(values.to(torch.bfloat16)) is None


def test_normalised_pixels_and_odd_dtypes_are_not_uint8() -> None:
    image = make_image(56, 56)
    pixels = Qwen2VLImageProcessorPil(**QWEN2_VL)(images=image, return_tensors="pt")
    assert to_uint8_pixels(pixels["pixel_values"]) is None
    assert to_uint8_pixels(torch.tensor([-1, 3])) is None
    assert to_uint8_pixels(torch.tensor([0, 256])) is None
    assert to_uint8_pixels(torch.tensor([True, False])) is None
    assert to_uint8_pixels(torch.tensor([1 + 0j])) is None


def test_raw_pixel_kwargs() -> None:
    assert raw_pixel_kwargs() == {"do_rescale": False, "do_normalize": False}
    kwargs = raw_pixel_kwargs()
    kwargs["do_rescale"] = True  # a fresh dict each call: callers may add to it
    assert raw_pixel_kwargs()["do_rescale"] is False


# --- NormSpec ---------------------------------------------------------------------------------


def test_from_image_processor_reads_the_processor_settings(image_processor) -> None:
    spec = NormSpec.from_image_processor(image_processor, layout=QWEN_LAYOUT)
    assert spec.mean == CLIP_MEAN and spec.std == CLIP_STD
    assert spec.rescale == 1 / 255
    assert spec.layout == ChannelLayout(axis=-1, block=392)
    assert spec.pixel_keys == ("pixel_values",)


def test_from_image_processor_honours_switched_off_steps() -> None:
    def ip(**kw):
        base = dict(
            do_rescale=True,
            rescale_factor=1 / 255,
            do_normalize=True,
            image_mean=0.5,
            image_std=0.5,
        )
        return SimpleNamespace(**{**base, **kw})

    spec = NormSpec.from_image_processor(ip(), layout=QWEN_LAYOUT)
    assert spec.mean == (0.5, 0.5, 0.5) and spec.std == (0.5, 0.5, 0.5)  # scalars repeated
    spec = NormSpec.from_image_processor(ip(do_rescale=False), layout=QWEN_LAYOUT)
    assert spec.rescale == 1.0
    spec = NormSpec.from_image_processor(
        ip(do_normalize=False, image_mean=None), layout=QWEN_LAYOUT
    )
    assert spec.mean == (0.0,) * 3 and spec.std == (1.0,) * 3 and spec.rescale == 1 / 255
    spec = NormSpec.from_image_processor(
        ip(do_rescale=False, do_normalize=False), layout=QWEN_LAYOUT
    )
    assert spec.is_identity
    # a full HF processor: its image_processor is used
    wrapper = SimpleNamespace(image_processor=ip(image_mean=np.array(CLIP_MEAN)))
    spec = NormSpec.from_image_processor(
        wrapper, layout=QWEN_LAYOUT, pixel_keys=["pixel_values", "pixel_values_videos"]
    )
    assert spec.mean == CLIP_MEAN
    assert spec.pixel_keys == ("pixel_values", "pixel_values_videos")
    with pytest.raises(ConfigurationError, match="image_std"):
        NormSpec.from_image_processor(ip(image_std=None), layout=QWEN_LAYOUT)


def test_wire_round_trip_uses_plain_values() -> None:
    spec = NormSpec(
        mean=CLIP_MEAN,
        std=CLIP_STD,
        rescale=1 / 255,
        layout=QWEN_LAYOUT,
        pixel_keys=("pixel_values", "pixel_values_videos"),
    )
    wire = spec.to_wire()
    assert json.loads(json.dumps(wire)) == wire  # dicts, lists, numbers and strings only
    assert NormSpec.from_wire(json.loads(json.dumps(wire))) == spec
    assert hash(NormSpec.from_wire(wire)) == hash(spec)
    # optional fields take their defaults
    wire = {"mean": [0.5], "std": [0.5], "rescale": 1, "layout": {"axis": -3}}
    spec = NormSpec.from_wire(wire)
    assert spec.layout == ChannelLayout.channels_first()
    assert spec.pixel_keys == ("pixel_values",)
    assert spec.rescale == 1.0 and isinstance(spec.rescale, float)


def _wire(**changes):
    wire = NormSpec(CLIP_MEAN, CLIP_STD, 1 / 255, QWEN_LAYOUT).to_wire()
    for key, value in changes.items():
        if key.startswith("layout_"):
            wire["layout"][key.removeprefix("layout_")] = value
        else:
            wire[key] = value
    return wire


@pytest.mark.parametrize(
    ("wire", "names"),
    [
        ([1, 2], "map"),
        ({k: v for k, v in _wire().items() if k != "std"}, "missing field(s) ['std']"),
        (_wire(extra=1), "unknown field(s) ['extra']"),
        (_wire(layout=[-1, 392]), "'layout' must be a map"),
        (_wire(layout_axis=None), "layout.axis"),
        (_wire(layout_axis=1), "layout.axis"),
        (_wire(layout_axis=True), "layout.axis"),
        (_wire(layout_block=0), "layout.block"),
        (_wire(layout_tiles=-2), "layout.tiles"),
        (_wire(layout_channels=3), "unknown field(s) ['channels']"),
        (_wire(mean="0.5"), "'mean' must be a list"),
        (_wire(mean=[]), "mean must be a non-empty list"),
        (_wire(mean=[0.5, "x", 0.5]), "mean[1]"),
        (_wire(mean=[0.5, math.nan, 0.5]), "mean[1] must be finite"),
        (_wire(std=[0.5, 0.5]), "one value per channel"),
        (_wire(std=[0.5, 0.0, 0.5]), "std must be > 0"),
        (_wire(std=[0.5, -0.5, 0.5]), "std must be > 0"),
        (_wire(rescale=0), "rescale must be > 0"),
        (_wire(rescale=math.inf), "rescale must be finite"),
        (_wire(rescale="1/255"), "rescale must be a number"),
        (_wire(pixel_keys=[]), "pixel_keys"),
        (_wire(pixel_keys=["a", "a"]), "pixel_keys"),
        (_wire(pixel_keys=["a", 3]), "pixel_keys"),
        (_wire(pixel_keys="pixel_values"), "'pixel_keys' must be a list"),
        # sizes a message could use to make the engine build huge buffers
        (_wire(layout_block=20_000_000), "layout.block must be <= 1048576"),
        (_wire(layout_block=2**62), "layout.block must be <= 1048576"),
        (_wire(layout_tiles=2**40), "layout.tiles must be <= 1048576"),
        (_wire(layout_block=2**10, layout_tiles=2**11), "layout.block * layout.tiles"),
        (_wire(layout_block=2**19), "layout.tiles * channels * layout.block must be <="),
        (_wire(layout_axis=-33), "layout.axis must be >= -32"),
        (_wire(mean=[0.5] * 65, std=[0.5] * 65), "mean must have at most 64 values"),
        (_wire(pixel_keys=[f"k{i}" for i in range(17)]), "pixel_keys must name at most 16"),
        (_wire(pixel_keys=["k" * 257]), "pixel_keys must be distinct names of 1 to 256"),
        (_wire(std=[0.5, 1e-300, 0.5]), "channel 1: rescale / std and mean / std must fit"),
    ],
)
def test_bad_wire_specs_raise_decode_error_naming_the_field(wire, names: str) -> None:
    with pytest.raises(DecodeError) as info:
        NormSpec.from_wire(wire)
    assert names in str(info.value)


def test_bad_specs_raise_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="std must be > 0"):
        NormSpec(CLIP_MEAN, (1.0, 0.0, 1.0), 1 / 255, QWEN_LAYOUT)
    with pytest.raises(ConfigurationError, match="layout must be a ChannelLayout"):
        NormSpec(CLIP_MEAN, CLIP_STD, 1 / 255, {"axis": -1})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"layout\.axis must be negative"):
        ChannelLayout(axis=0)
    # lists are accepted and stored as tuples, so specs stay hashable
    spec = NormSpec(list(CLIP_MEAN), list(CLIP_STD), 1 / 255, QWEN_LAYOUT, ["pixel_values"])  # type: ignore[arg-type]
    assert spec.mean == CLIP_MEAN and spec.pixel_keys == ("pixel_values",)
    hash(spec)


def test_every_size_a_spec_may_ask_for_builds_buffers_of_a_few_mib_at_most() -> None:
    layout = ChannelLayout(axis=-1, block=MAX_AXIS_LENGTH // MAX_CHANNELS)
    spec = NormSpec((0.5,) * MAX_CHANNELS, (0.5,) * MAX_CHANNELS, 1 / 255, layout)
    module = FusedInputNorm(spec, dtype=torch.float32)
    assert module.weight.nbytes + module.bias.nbytes == 8 * MAX_AXIS_LENGTH  # 8 MiB
    with pytest.raises(ConfigurationError, match=r"layout\.tiles \* channels"):
        NormSpec((0.5,) * 3, (0.5,) * 3, 1 / 255, ChannelLayout(axis=-1, block=MAX_AXIS_LENGTH))


def test_check_shape_says_whether_a_tensor_has_the_channel_axis() -> None:
    spec = NormSpec(CLIP_MEAN, CLIP_STD, 1 / 255, QWEN_LAYOUT)
    spec.check_shape((4, 1176))
    spec.check_shape((2, 4, 1176))
    for shape in [(4, 1175), (1176, 4), ()]:
        with pytest.raises(ConfigurationError, match="expects dimension -1 of length 1176"):
            spec.check_shape(shape)


def test_public_names() -> None:
    assert fused_norm.__all__ == sorted(fused_norm.__all__)
    for name in fused_norm.__all__:
        assert getattr(fused_norm, name).__doc__
