"""The qwen_vl demo folders load with transformers' Auto classes, offline, as the hub's do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmproc.testing import build_tokenizer
from mmproc_qwen_vl.demo import (
    QWEN2_5_VL_ADDED_TOKENS,
    QWEN2_VL_SPECIAL_TOKENS,
    write_qwen2_vl_folder,
)
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

QWEN_PROMPT = "what is in <|vision_start|><|image_pad|><|vision_end|> this picture?"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
TEXTS = [
    "Hello world! What's in this picture?",
    "  two spaces,\n\nnew lines, digits 12345 and ünïcödé 汉字 😀",
    "the cat sat on the mat<|im_end|>",
]


def image(width: int = 90, height: int = 60) -> Image.Image:
    rng = np.random.default_rng(width * 1000 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def load(folder: Path, **kwargs: Any) -> Any:
    return AutoProcessor.from_pretrained(folder, local_files_only=True, **kwargs)


QWEN_CASES = [
    ("qwen2_vl", "hub", "Qwen2VLProcessor"),
    ("qwen2_vl", "save_pretrained", "Qwen2VLProcessor"),
    ("qwen2_5_vl", "hub", "Qwen2_5_VLProcessor"),
    ("qwen2_5_vl", "save_pretrained", "Qwen2_5_VLProcessor"),
]


@pytest.fixture(scope="module", params=QWEN_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    variant, layout, processor_class = request.param
    folder = write_qwen2_vl_folder(
        tmp_path_factory.mktemp(f"{variant}-{layout}"), variant=variant, layout=layout
    )
    return variant, layout, processor_class, folder


def test_qwen_folder_files(qwen: Any) -> None:
    _, layout, _, folder = qwen
    files = {p.name for p in folder.iterdir()}
    if layout == "hub":
        assert {"preprocessor_config.json", "chat_template.json"} <= files
        saved = json.loads((folder / "preprocessor_config.json").read_text())
        assert saved["min_pixels"] == 3136 and saved["max_pixels"] == 12845056
        assert saved["image_processor_type"] == "Qwen2VLImageProcessor"
    else:
        assert {"processor_config.json", "chat_template.jinja"} <= files
        assert "preprocessor_config.json" not in files
        saved = json.loads((folder / "processor_config.json").read_text())
        assert saved["image_processor"]["size"] == {
            "longest_edge": 12845056,
            "shortest_edge": 3136,
        }
        assert "video_processor" in saved
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files


def test_qwen_folder_loads_and_expands_the_image_placeholder(qwen: Any) -> None:
    variant, _, processor_class, folder = qwen
    processor = load(folder)
    assert type(processor).__name__ == processor_class
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    ip = processor.image_processor
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 2)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (3136, 12845056)
    assert list(ip.image_mean) == CLIP_MEAN and list(ip.image_std) == CLIP_STD
    assert int(ip.resample) == 3  # bicubic

    out = processor(text=[QWEN_PROMPT], images=[image(90, 60)])
    grid = np.asarray(out["image_grid_thw"])
    assert grid.tolist() == [[1, 4, 6]]
    assert np.asarray(out["pixel_values"]).shape == (24, 3 * 2 * 14 * 14)
    ids = list(out["input_ids"][0])
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert config.model_type == variant
    assert ids.count(config.image_token_id) == 24 // 4
    start = ids.index(config.vision_start_token_id)
    assert ids[start + 1 : start + 7] == [config.image_token_id] * 6
    assert ids[start + 7] == config.vision_end_token_id


def test_qwen_tokenizer_round_trips_through_the_folder(qwen: Any) -> None:
    variant, _, _, folder = qwen
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    added = QWEN2_5_VL_ADDED_TOKENS if variant == "qwen2_5_vl" else ()
    built = build_tokenizer(
        QWEN2_VL_SPECIAL_TOKENS,
        named_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        added_tokens=added,
    )
    for text in [*TEXTS, QWEN_PROMPT, "<tool_call>{}</tool_call>"]:
        assert loaded(text).input_ids == built(text).input_ids
    ids = [loaded.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    for token in QWEN2_VL_SPECIAL_TOKENS:
        assert loaded.tokenize(f"a{token}b") == ["a", token, "b"]
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    assert set(QWEN2_VL_SPECIAL_TOKENS) <= set(loaded.all_special_tokens)
    if added:
        assert not set(added) & set(loaded.all_special_tokens)


def test_qwen_chat_template_renders_the_vision_markers(qwen: Any) -> None:
    processor = load(qwen[3])
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen_pil_backend(tmp_path: Path) -> None:
    folder = write_qwen2_vl_folder(tmp_path)
    # transformers 5: backend="pil" reaches the video processor too, which has no PIL class.
    with pytest.raises(ImportError, match="pil backend is not available"):
        load(folder, backend="pil")
    # What works: the PIL image processor, handed to the processor (video stays torchvision).
    pil = AutoImageProcessor.from_pretrained(folder, local_files_only=True, backend="pil")
    assert type(pil).__name__ == "Qwen2VLImageProcessorPil"
    processor = load(folder, image_processor=pil)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    with_pil = processor(text=[QWEN_PROMPT], images=[image(300, 200)])
    with_tv = load(folder)(text=[QWEN_PROMPT], images=[image(300, 200)])
    assert list(with_pil["input_ids"][0]) == list(with_tv["input_ids"][0])
    assert np.array_equal(np.asarray(with_pil["image_grid_thw"]), with_tv["image_grid_thw"])


def test_qwen2_5_hub_class_name_quirk(tmp_path: Path) -> None:
    folder = write_qwen2_vl_folder(
        tmp_path, variant="qwen2_5_vl", image_processor_type="Qwen2_5_VLImageProcessor"
    )
    saved = json.loads((folder / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "Qwen2_5_VLImageProcessor"
    # transformers 5.24 has no such class and gives up ...
    with pytest.raises(ValueError, match="Unrecognized image processor"):
        load(folder)
    # ... unless the model config is passed, which maps qwen2_5_vl to Qwen2-VL's processor.
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    for backend, name in [
        ("torchvision", "Qwen2VLImageProcessor"),
        ("pil", "Qwen2VLImageProcessorPil"),
    ]:
        ip = AutoImageProcessor.from_pretrained(
            folder, local_files_only=True, config=config, backend=backend
        )
        assert type(ip).__name__ == name


def test_qwen_folder_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="variant"):
        write_qwen2_vl_folder(tmp_path, variant="qwen3_vl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout"):
        write_qwen2_vl_folder(tmp_path, layout="flat")  # type: ignore[arg-type]
