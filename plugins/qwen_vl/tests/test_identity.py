"""mmproc's Qwen2-VL / Qwen2.5-VL output equals calling the transformers processor directly.

The folders are written by ``mmproc.testing`` with the models' real special tokens and hub
preprocessor settings (patch 14, merge 2, temporal patch 2, min_pixels 3136, max_pixels 12845056,
CLIP mean / std, bicubic). The reference is a transformers processor built independently of the
plugin: ``AutoProcessor`` on the same folder with the chosen backend's image processor class,
called with ``text=[prompt], images=..., videos=..., return_tensors="pt"``. What must match:
prompt ids, per-item tensors (concatenated in item order), grids, and placeholder ranges (the runs
of pad tokens in transformers' ids). With device normalisation on (the default) mmproc's pixels
are uint8 and ``FusedInputNorm`` of them must come within 1e-6 of transformers' float pixels;
with it off they must be equal.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.plugin import BatchedField, ConfigurationError, FlatField, MmprocError
from mmproc.testing import call_hf_processor, noise_image, noise_video
from mmproc.testing.conformance import assert_matches_hf
from mmproc_qwen_vl import shared as qwen_shared
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from mmproc_qwen_vl.image_fast_path import ImageSizeError
from mmproc_qwen_vl.model import num_image_tokens
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
BACKENDS = ("pil", "torchvision")
IMAGE_PROCESSOR_CLASSES = {"pil": Qwen2VLImageProcessorPil, "torchvision": Qwen2VLImageProcessor}
# (backend, device_normalize): every test that takes `combo` runs on all four processors.
COMBOS = [(backend, norm) for backend in BACKENDS for norm in (True, False)]
COMBO_IDS = [f"{backend}-{'device_norm' if norm else 'cpu_norm'}" for backend, norm in COMBOS]

# How each output joins across items, as the test states it (not read from the plugin).
FIELDS = {
    "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
    "image_grid_thw": BatchedField("image"),
    "pixel_values_videos": FlatField.from_grid("video", "video_grid_thw"),
    "video_grid_thw": BatchedField("video"),
    "second_per_grid_ts": BatchedField("video"),  # Qwen2.5-VL
}
PAD_TOKENS = {"image": "<|image_pad|>", "video": "<|video_pad|>"}

# The real Qwen2-VL hub settings the folders carry; the processors must load exactly these.
SETTINGS = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
    "resample": int(Image.Resampling.BICUBIC),
}

# (width, height): tiny, thin, extreme (200:1 both ways, the largest ratio accepted), odd.
SIZES = [
    (1, 1),
    (10, 1000),
    (1000, 10),
    (200, 1),
    (1, 200),
    (400, 2),
    (4000, 20),
    (3, 600),
    (28, 28),
    (57, 113),
    (333, 77),
]
MODES = ["RGB", "L", "LA", "RGBA", "P", "P+transparency", "1", "CMYK"]


# --- helpers ------------------------------------------------------------------------------------


def build_reference(folder: Path, backend: str) -> Any:
    """transformers' processor for ``folder``, built without the plugin."""
    image_processor = IMAGE_PROCESSOR_CLASSES[backend].from_pretrained(
        folder, local_files_only=True
    )
    return AutoProcessor.from_pretrained(
        folder, local_files_only=True, image_processor=image_processor
    )


def assert_identical(
    out: mmproc.ProcessedInputs,
    hf: Any,
    tokenizer: Any,
    *,
    normalised: bool,
    bf16: bool = True,
    context: str = "",
) -> None:
    """``out`` equals transformers' output ``hf`` for the same request (the kit's conformance)."""
    pads = {m: tokenizer.convert_tokens_to_ids(t) for m, t in PAD_TOKENS.items()}
    assert_matches_hf(
        out,
        hf,
        fields=FIELDS,
        placeholder_token_ids=pads,
        normalised=normalised,
        check_bf16=bf16,
        context=context,
    )


def write_reference_copy(folder: Path, destination: Path) -> Path:
    """A copy of a Qwen2.5-VL hub folder whose image processor class transformers knows."""
    shutil.copytree(folder, destination)
    path = destination / "preprocessor_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["image_processor_type"] = "Qwen2VLImageProcessor"
    path.write_text(json.dumps(config), encoding="utf-8")
    return destination


def image_backend(processor: mmproc.Processor) -> str:
    """The image backend of an mmproc processor."""
    image_processor = processor.hf_processor.image_processor
    return "pil" if isinstance(image_processor, Qwen2VLImageProcessorPil) else "torchvision"


def assert_real_settings(processor: Any) -> None:
    """The image and video processors hold the Qwen2-VL hub settings."""
    for component in (processor.image_processor, processor.video_processor):
        size = component.size
        loaded = {
            "patch_size": component.patch_size,
            "merge_size": component.merge_size,
            "temporal_patch_size": component.temporal_patch_size,
            "min_pixels": size["shortest_edge"],
            "max_pixels": size["longest_edge"],
            "image_mean": tuple(component.image_mean),
            "image_std": tuple(component.image_std),
            "resample": int(component.resample),
        }
        assert loaded == SETTINGS, type(component).__name__
        assert component.do_rescale and component.do_normalize and component.do_convert_rgb


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_folder(tmp_path_factory.mktemp("qwen2_vl") / "hub")


@pytest.fixture(scope="module")
def references(folder: Path) -> dict[str, Any]:
    return {backend: build_reference(folder, backend) for backend in BACKENDS}


@pytest.fixture(scope="module")
def processors(folder: Path) -> Iterator[dict[tuple[str, bool], mmproc.Processor]]:
    """The four (backend, device_normalize) processors, on the defaults for the rest."""
    with ExitStack() as stack:
        environment = stack.enter_context(pytest.MonkeyPatch.context())
        for name in ("MMPROC_WORKERS", "MMPROC_CACHE_BYTES"):  # the defaults are under test
            environment.delenv(name, raising=False)
        yield {
            (backend, norm): stack.enter_context(
                mmproc.get_processor(folder, backend=backend, device_normalize=norm)
            )
            for backend, norm in COMBOS
        }


@pytest.fixture(params=COMBOS, ids=COMBO_IDS)
def combo(request: pytest.FixtureRequest, processors, references) -> tuple[Any, Any, bool]:
    """(mmproc processor, transformers reference, device_normalize) for one combination."""
    backend, norm = request.param
    return processors[request.param], references[backend], norm


# --- images -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_size_and_mode_matches_hf(combo, mode: str) -> None:
    processor, reference, norm = combo
    assert (processor.norm_spec is not None) is norm
    for seed, (width, height) in enumerate(SIZES):
        image = noise_image(width, height, mode, seed=1000 + seed)
        prompt = f"describe {IMAGE} please"
        out = processor.process(prompt, {"image": [image]})
        hf = call_hf_processor(reference, prompt, {"image": [image]})
        context = f"{width}x{height} {mode}"
        assert_identical(out, hf, reference.tokenizer, normalised=norm, context=context)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_request_hf_kwargs_match_hf_and_are_part_of_the_cache_key(
    processors, references, backend: str
) -> None:
    processor, reference = processors[(backend, True)], references[backend]
    image = noise_image(800, 600, seed=2200)
    prompt = f"{IMAGE} small"
    sizes = []
    smaller, smallest = (
        {"size": {"shortest_edge": SETTINGS["min_pixels"], "longest_edge": n * 28 * 28}}
        for n in (200, 100)
    )
    for hf_kwargs in ({}, smaller, smallest, {}):
        before = processor.cache.stats()
        out = processor.process(prompt, {"image": [image]}, hf_kwargs=hf_kwargs)
        hf = call_hf_processor(reference, prompt, {"image": [image]}, **hf_kwargs)
        assert_identical(out, hf, reference.tokenizer, normalised=True, context=str(hf_kwargs))
        sizes.append(out.features[0].placeholder.length)
        hit = processor.cache.stats().hits - before.hits
        assert hit == (1 if len(sizes) == 4 else 0), hf_kwargs  # only the repeat is a hit
    assert sizes[0] == sizes[3] and len(set(sizes[:3])) == 3


def test_a_bad_item_in_a_multi_image_request_fails_it_and_the_next_is_served(combo) -> None:
    processor, reference, norm = combo
    good, wide = noise_image(40, 50, seed=3000), noise_image(2010, 10, seed=3001)  # 201:1
    with pytest.raises(MmprocError, match="aspect ratio"):
        processor.process(f"{IMAGE}{IMAGE}", {"image": [good, wide]})
    prompt = f"{IMAGE} again"
    out = processor.process(prompt, {"image": [good]})
    assert_identical(
        out,
        call_hf_processor(reference, prompt, {"image": [good]}),
        reference.tokenizer,
        normalised=norm,
    )


@pytest.mark.parametrize("size", [(201, 1), (1, 201), (1000, 4), (3, 1000)])
def test_beyond_200_to_1_is_a_clear_error_and_the_processor_keeps_serving(combo, size) -> None:
    processor, reference, norm = combo
    width, height = size
    with pytest.raises(MmprocError, match="aspect ratio") as caught:
        processor.process(IMAGE, {"image": [noise_image(width, height, seed=4000)]})
    assert "200" in str(caught.value)
    # transformers refuses the same image
    with pytest.raises(ValueError, match="aspect ratio"):
        call_hf_processor(reference, IMAGE, {"image": [noise_image(width, height, seed=4000)]})
    # 200:1 exactly still works, and matches
    ok = noise_image(*((200, 1) if width > height else (1, 200)), seed=4001)
    out = processor.process(IMAGE, {"image": [ok]})
    assert_identical(
        out,
        call_hf_processor(reference, IMAGE, {"image": [ok]}),
        reference.tokenizer,
        normalised=norm,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_4000x3000_image_matches_hf(processors, references, backend: str) -> None:
    processor, reference = processors[(backend, True)], references[backend]  # the defaults
    image = noise_image(4000, 3000, seed=5000).convert("RGB")
    out = processor.process(f"big {IMAGE}", {"image": [image]})
    hf = call_hf_processor(reference, f"big {IMAGE}", {"image": [image]})
    assert_identical(out, hf, reference.tokenizer, normalised=True, bf16=False)
    grid = hf["image_grid_thw"][0].tolist()
    assert out.features[0].placeholder.length == grid[0] * grid[1] * grid[2] // 4
    assert (
        num_image_tokens(processor.hf_processor, 3000, 4000) == out.features[0].placeholder.length
    )


def test_pil_fast_path_is_taken_and_bit_identical(
    processors, references, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PIL backend + device normalisation: images never go through transformers' float path."""
    calls: list[int] = []
    original = qwen_shared.patchify_uint8

    def spy(images: Any, **settings: Any) -> Any:
        calls.append(len(images))
        return original(images, **settings)

    monkeypatch.setattr(qwen_shared, "patchify_uint8", spy)
    reference = references["pil"]
    shapes = [(1, 1, "RGB"), (90, 60, "RGBA"), (200, 1, "P+transparency"), (17, 333, "L")]
    images = [noise_image(w, h, mode, seed=6000 + i) for i, (w, h, mode) in enumerate(shapes)]
    prompt = f"look {IMAGE}{IMAGE} and {IMAGE}{IMAGE}"
    out = processors[("pil", True)].process(prompt, {"image": images})
    assert calls == [4]
    raw = call_hf_processor(
        reference, prompt, {"image": images}, do_rescale=False, do_normalize=False
    )
    raw_pixels = raw["pixel_values"]
    assert raw_pixels.dtype == torch.float32
    assert torch.equal(raw_pixels.to(torch.uint8).to(torch.float32), raw_pixels)  # whole numbers
    pixels = torch.cat([f.data["pixel_values"] for f in out.features])
    assert pixels.dtype == torch.uint8
    assert torch.equal(pixels, raw_pixels.to(torch.uint8))
    assert_identical(
        out,
        call_hf_processor(reference, prompt, {"image": images}),
        reference.tokenizer,
        normalised=True,
    )

    # Not taken where it does not apply: torchvision backend, or normalisation on the CPU.
    for key in [("torchvision", True), ("pil", False)]:
        processors[key].process(IMAGE, {"image": [noise_image(33, 44, seed=6100)]})
    assert calls == [4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_image_tokens_equals_the_placeholder_length(processors, backend: str) -> None:
    processor = processors[(backend, True)]
    hf_processor = processor.hf_processor
    sizes = [*SIZES, (640, 480), (1, 56), (1920, 1080)]
    for seed, (width, height) in enumerate(sizes):
        out = processor.process(IMAGE, {"image": [noise_image(width, height, seed=7000 + seed)]})
        length = out.features[0].placeholder.length
        assert num_image_tokens(hf_processor, height, width) == length, (width, height)
        assert num_image_tokens(hf_processor.image_processor, height, width) == length
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        num_image_tokens(hf_processor, 1, 201)


# --- video --------------------------------------------------------------------------------------


def test_video_matches_hf(combo) -> None:
    processor, reference, norm = combo
    array = noise_video(4, 90, 60, seed=8000)
    odd = noise_video(3, 50, 70, seed=8001)  # an odd frame count: the last frame is repeated
    frames = [Image.fromarray(frame) for frame in noise_video(2, 33, 47, seed=8002)]
    tensor = torch.from_numpy(noise_video(2, 30, 20, seed=8005)).permute(0, 3, 1, 2)  # T,C,H,W
    gray = np.ascontiguousarray(noise_video(2, 40, 30, seed=8006)[..., :1])  # (T, H, W, 1)
    images = [noise_image(30, 40, seed=8003), noise_image(64, 20, "P", seed=8004)]
    if norm:
        assert "pixel_values_videos" in processor.norm_spec.pixel_keys
    # (prompt, mm_data, what transformers gets as images, as videos)
    cases: list[tuple[str, dict[str, Any], list[Any], list[Any]]] = [
        (f"watch {VIDEO} now", {"video": [array]}, [], [array]),
        (f"watch {VIDEO} now", {"video": frames}, [], [frames]),  # one video as a frame list
        (f"watch {VIDEO} now", {"video": [tensor]}, [], [tensor.contiguous()]),
        (f"watch {VIDEO} now", {"video": [gray]}, [], [gray]),
        (
            f"{IMAGE} then {VIDEO} then {VIDEO} and {IMAGE}",
            {"image": images, "video": [odd, array]},
            images,
            [odd, array],
        ),
    ]
    for index, (prompt, mm_data, images, videos) in enumerate(cases):
        out = processor.process(prompt, mm_data)
        hf = call_hf_processor(reference, prompt, {"image": images, "video": videos})
        assert_identical(out, hf, reference.tokenizer, normalised=norm, context=f"case {index}")


# --- loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["hub", "save_pretrained"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_folder_layouts_load_the_real_settings_and_match_hf(
    tmp_path_factory: pytest.TempPathFactory, folder: Path, layout: str, backend: str
) -> None:
    if layout == "hub":
        path = folder
    else:
        path = write_qwen2_vl_folder(tmp_path_factory.mktemp("saved") / "qwen", layout=layout)
        assert (path / "processor_config.json").is_file()
        assert not (path / "preprocessor_config.json").exists()
    reference = build_reference(path, backend)
    image, video = noise_image(70, 35, "LA", seed=9000), noise_video(2, 40, 30, seed=9001)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}]}]
    prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with mmproc.get_processor(path, backend=backend) as processor:
        hf_processor = processor.hf_processor
        assert isinstance(hf_processor.image_processor, IMAGE_PROCESSOR_CLASSES[backend])
        assert isinstance(hf_processor.video_processor, Qwen2VLVideoProcessor)
        assert_real_settings(hf_processor)
        ours = hf_processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert ours == prompt
        out = processor.process(prompt, {"image": [image], "video": [video]})
    hf = call_hf_processor(reference, prompt, {"image": [image], "video": [video]})
    assert_identical(out, hf, reference.tokenizer, normalised=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen2_5_vl_hub_folder_naming_qwen2_5_vl_image_processor(
    tmp_path_factory: pytest.TempPathFactory, backend: str
) -> None:
    root = tmp_path_factory.mktemp("qwen2_5_vl")
    path = write_qwen2_vl_folder(
        root / "hub", variant="qwen2_5_vl", image_processor_type="Qwen2_5_VLImageProcessor"
    )
    written = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8"))
    assert written["image_processor_type"] == "Qwen2_5_VLImageProcessor"
    # The reference: the same folder, naming a class transformers has.
    reference = build_reference(write_reference_copy(path, root / "reference"), backend)
    assert type(reference).__name__ == "Qwen2_5_VLProcessor"
    images = [noise_image(50, 90, seed=9100), noise_image(300, 20, "RGBA", seed=9101)]
    video = noise_video(3, 60, 40, seed=9102)
    # Qwen2.5's tool-call tokens are added, non-special tokens: they must stay single ids.
    prompt = f"<tool_call>{IMAGE} then {VIDEO}</tool_call> and {IMAGE}"
    for norm in (True, False):
        with mmproc.get_processor(path, backend=backend, device_normalize=norm) as processor:
            assert type(processor.hf_processor).__name__ == "Qwen2_5_VLProcessor"
            assert isinstance(
                processor.hf_processor.image_processor, IMAGE_PROCESSOR_CLASSES[backend]
            )
            assert_real_settings(processor.hf_processor)
            out = processor.process(prompt, {"image": images, "video": [video]})
        hf = call_hf_processor(reference, prompt, {"image": images, "video": [video]})
        assert "second_per_grid_ts" in hf
        assert_identical(out, hf, reference.tokenizer, normalised=norm, context=f"norm={norm}")


def test_hub_folder_loads_the_same_tokenizer_transformers_does(folder: Path) -> None:
    with mmproc.get_processor(folder) as processor:
        ours = processor.hf_processor.tokenizer
    theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = f"<|im_start|>user\n{IMAGE}describe the picture, please<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    for token in ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"):
        assert len(ours.encode(token, add_special_tokens=False)) == 1


def test_an_unknown_backend_is_a_configuration_error(folder: Path) -> None:
    with pytest.raises(ConfigurationError, match="backend"):
        mmproc.get_processor(folder, backend="opencv")


# --- the worker pool ----------------------------------------------------------------------------
