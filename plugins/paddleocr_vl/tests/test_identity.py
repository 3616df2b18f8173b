"""mmproc's PaddleOCR-VL output equals calling the transformers processor directly.

The folders are written by ``mmproc.testing`` with the model's real special tokens and hub
preprocessor settings (patch 14, merge 2, temporal patch 1, min_pixels 147384, max_pixels 2822400,
mean / std 0.5, bicubic). The reference is transformers' ``AutoProcessor`` on the same folder with
the chosen ``backend``, built without the plugin, called with ``text=[prompt], images=...,
return_tensors="pt"``. What must match: prompt ids, per-item patches (concatenated in item
order), grids, and placeholder ranges (the runs of ``<|IMAGE_PLACEHOLDER|>`` in transformers'
ids). With device normalisation on (the default) mmproc's pixels are uint8 and ``FusedInputNorm``
of them must come within 1e-6 of transformers' float pixels; with it off they must be equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import mmproc
import pytest
import torch
from mmproc.plugin import BatchedField, ConfigurationError, FlatField, MmprocError
from mmproc.testing import call_hf_processor, noise_image
from mmproc.testing.conformance import assert_matches_hf
from mmproc_paddleocr_vl.demo import write_paddleocr_vl_folder
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer
from transformers.models.paddleocr_vl.image_processing_paddleocr_vl import (
    PaddleOCRVLImageProcessor,
)
from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
    PaddleOCRVLImageProcessorPil,
)

IMAGE = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
PAD = "<|IMAGE_PLACEHOLDER|>"
BACKENDS = ("pil", "torchvision")
IMAGE_PROCESSOR_CLASSES = {
    "pil": PaddleOCRVLImageProcessorPil,
    "torchvision": PaddleOCRVLImageProcessor,
}
# (backend, device_normalize): every test that takes `combo` runs on all four processors.
COMBOS = [(backend, norm) for backend in BACKENDS for norm in (True, False)]
COMBO_IDS = [f"{backend}-{'device_norm' if norm else 'cpu_norm'}" for backend, norm in COMBOS]
# How each output joins across items, as the test states it (not read from the plugin).
FIELDS = {
    "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
    "image_grid_thw": BatchedField("image"),
}

# The real PaddleOCR-VL hub settings the folders carry; the processors must load exactly these.
SETTINGS = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 1,
    "min_pixels": 147384,
    "max_pixels": 2822400,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "resample": int(Image.Resampling.BICUBIC),
}

# (width, height): tiny, thin, extreme (200:1 both ways, the largest ratio accepted), odd,
# and sizes on either side of min_pixels / between the bounds.
SIZES = [
    (1, 1),
    (10, 1000),
    (1000, 10),
    (200, 1),
    (1, 200),
    (400, 2),
    (4000, 20),
    (28, 28),
    (57, 113),
    (384, 384),
    (613, 411),
]
MODES = ["RGB", "L", "LA", "RGBA", "P", "P+transparency", "1", "CMYK"]


# --- helpers ------------------------------------------------------------------------------------


def build_reference(folder: Path, backend: str) -> Any:
    """transformers' processor for ``folder`` and ``backend``, built without the plugin."""
    reference = AutoProcessor.from_pretrained(folder, local_files_only=True, backend=backend)
    assert isinstance(reference.image_processor, IMAGE_PROCESSOR_CLASSES[backend])
    return reference


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
    assert_matches_hf(
        out,
        hf,
        fields=FIELDS,
        placeholder_token_ids={"image": tokenizer.convert_tokens_to_ids(PAD)},
        normalised=normalised,
        check_bf16=bf16,
        context=context,
    )


def image_backend(processor: mmproc.Processor) -> str:
    """The image backend of an mmproc processor."""
    image_processor = processor.hf_processor.image_processor
    return "pil" if isinstance(image_processor, PaddleOCRVLImageProcessorPil) else "torchvision"


def assert_real_settings(processor: Any) -> None:
    """The image processor holds the PaddleOCR-VL hub settings."""
    component = processor.image_processor
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
    return write_paddleocr_vl_folder(tmp_path_factory.mktemp("paddleocr_vl") / "hub")


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
        prompt = f"OCR: {IMAGE}"
        out = processor.process(prompt, {"image": [image]})
        hf = call_hf_processor(reference, prompt, {"image": [image]})
        context = f"{width}x{height} {mode}"
        assert_identical(out, hf, reference.tokenizer, normalised=norm, context=context)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_request_hf_kwargs_match_hf_and_are_part_of_the_cache_key(
    processors, references, backend: str
) -> None:
    processor, reference = processors[(backend, True)], references[backend]
    image = noise_image(1500, 1200, seed=2200)
    prompt = f"{IMAGE} small"
    sizes = []
    smaller, smallest = (
        {"size": {"shortest_edge": SETTINGS["min_pixels"], "longest_edge": n * 28 * 28}}
        for n in (1000, 500)
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
    out = processor.process(f"OCR: {IMAGE}", {"image": [image]})
    hf = call_hf_processor(reference, f"OCR: {IMAGE}", {"image": [image]})
    assert_identical(out, hf, reference.tokenizer, normalised=True, bf16=False)
    # Brought down to max_pixels: the grid's area is at most 2822400 pixels.
    _, grid_h, grid_w = hf["image_grid_thw"][0].tolist()
    assert grid_h * grid_w * 14 * 14 <= SETTINGS["max_pixels"]
    assert out.features[0].placeholder.length == grid_h * grid_w // 4


def test_pixels_are_raw_uint8_with_device_normalisation(processors, references) -> None:
    """The uint8 patches are transformers' pixels with rescale and normalise off, exactly."""
    images = [noise_image(90, 60, "RGBA", seed=6000), noise_image(17, 333, "L", seed=6001)]
    prompt = f"{IMAGE}{IMAGE}"
    for backend in BACKENDS:
        out = processors[(backend, True)].process(prompt, {"image": images})
        raw = call_hf_processor(
            references[backend], prompt, {"image": images}, do_rescale=False, do_normalize=False
        )
        raw_pixels = raw["pixel_values"]
        assert torch.equal(raw_pixels.round(), raw_pixels)  # whole numbers
        pixels = torch.cat([f.data["pixel_values"] for f in out.features])
        assert pixels.dtype == torch.uint8
        assert torch.equal(pixels, raw_pixels.to(torch.uint8)), backend


# --- loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["hub", "save_pretrained"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_folder_layouts_load_the_real_settings_and_match_hf(
    tmp_path_factory: pytest.TempPathFactory, folder: Path, layout: str, backend: str
) -> None:
    if layout == "hub":
        path = folder
    else:
        path = write_paddleocr_vl_folder(tmp_path_factory.mktemp("saved") / "paddle", layout=layout)
        assert (path / "processor_config.json").is_file()
        assert not (path / "preprocessor_config.json").exists()
    reference = build_reference(path, backend)
    images = [noise_image(70, 35, "LA", seed=9000), noise_image(500, 700, seed=9001)]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "OCR:"}],
        }
    ]
    prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with mmproc.get_processor(path, backend=backend) as processor:
        hf_processor = processor.hf_processor
        assert type(hf_processor).__name__ == "PaddleOCRVLProcessor"
        assert isinstance(hf_processor.image_processor, IMAGE_PROCESSOR_CLASSES[backend])
        assert_real_settings(hf_processor)
        ours = hf_processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert ours == prompt
        out = processor.process(prompt, {"image": images})
    hf = call_hf_processor(reference, prompt, {"image": images})
    assert_identical(out, hf, reference.tokenizer, normalised=True)


def test_hub_folder_loads_the_same_tokenizer_transformers_does(folder: Path) -> None:
    with mmproc.get_processor(folder) as processor:
        ours = processor.hf_processor.tokenizer
    theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = f"<|begin_of_sentence|>User: {IMAGE}read the text, please\nAssistant:\n"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    for token in ("<|IMAGE_START|>", PAD, "<|IMAGE_END|>"):
        assert len(ours.encode(token, add_special_tokens=False)) == 1


def test_an_unknown_backend_is_a_configuration_error(folder: Path) -> None:
    with pytest.raises(ConfigurationError, match="backend"):
        mmproc.get_processor(folder, backend="opencv")


# --- the worker pool ----------------------------------------------------------------------------
