"""The Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE demo folders load with transformers' Auto
classes, offline, as the hub's do: the processor classes, the checkpoints' settings, the real
special tokens in their order, Qwen3.5's forced tokenizer class, both folder layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mmproc.testing import build_tokenizer
from mmproc_qwen_vl.demo import (
    QWEN2_VL_SPECIAL_TOKENS,
    QWEN3_ADDED_TOKENS,
    QWEN3_VARIANTS,
    write_qwen3_vl_folder,
)
from transformers import AutoConfig, AutoProcessor, AutoTokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.models.qwen3_5.tokenization_qwen3_5 import (
    PRETOKENIZE_REGEX as QWEN3_5_PRETOKENIZE_REGEX,
)

TEXTS = [
    "Hello world! What's in this video?",
    "  two spaces,\n\nnew lines, digits 12345 and ünïcödé 汉字 😀 e\u0301",
    "<0.2 seconds><|vision_start|><|video_pad|><|vision_end|><1.2 seconds>",
    "<think>\nmaybe\n</think>\n\n<tool_call>{}</tool_call>",
]


@pytest.fixture(
    scope="module",
    params=[(v, layout) for v in QWEN3_VARIANTS for layout in ("hub", "save_pretrained")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    variant, layout = request.param
    root = tmp_path_factory.mktemp(f"{variant}-{layout}")
    return variant, layout, write_qwen3_vl_folder(root / "model", variant=variant, layout=layout)


def test_the_folder_has_the_hub_files_of_its_layout(written: Any) -> None:
    variant, layout, folder = written
    files = {path.name for path in folder.iterdir()}
    template = (
        "chat_template.jinja"
        if variant.startswith("qwen3_5") or layout != "hub"
        else ("chat_template.json")
    )
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", template} <= files
    if layout == "hub":
        image = json.loads((folder / "preprocessor_config.json").read_text())
        video = json.loads((folder / "video_preprocessor_config.json").read_text())
        assert image["image_processor_type"] == "Qwen2VLImageProcessorFast"
        assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
        assert (image["size"], video["size"]) == (
            {"longest_edge": 16777216, "shortest_edge": 65536},
            {"longest_edge": 25165824, "shortest_edge": 4096},
        )
    else:
        saved = json.loads((folder / "processor_config.json").read_text())
        assert {"image_processor", "video_processor"} <= set(saved)
        assert "preprocessor_config.json" not in files


def test_transformers_loads_the_qwen3_processor_with_the_checkpoints_settings(
    written: Any,
) -> None:
    variant, _, folder = written
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    image, video = processor.image_processor, processor.video_processor
    assert type(image).__name__ == "Qwen2VLImageProcessor"
    assert type(video).__name__ == "Qwen3VLVideoProcessor"
    for part in (image, video):
        assert (part.patch_size, part.merge_size, part.temporal_patch_size) == (16, 2, 2)
        assert list(part.image_mean) == list(part.image_std) == [0.5, 0.5, 0.5]
        assert int(part.resample) == 3  # bicubic
    assert (video.fps, video.min_frames, video.max_frames) == (2, 4, 768)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert config.model_type == variant
    assert config.architectures == [QWEN3_VARIANTS[variant]["architecture"]]
    tokenizer = processor.tokenizer
    for name in ("image", "video", "vision_start", "vision_end"):
        assert getattr(config, f"{name}_token_id") == getattr(processor, f"{name}_token_id")
    assert processor.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_the_tokenizer_is_the_families_with_the_real_tokens_in_order(written: Any) -> None:
    variant, layout, folder = written
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    qwen3_5 = variant.startswith("qwen3_5")
    if layout == "hub":
        # Qwen3.5 folders name Qwen2Tokenizer, as the hub's do; transformers forces its own class.
        named = json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
        assert named == "Qwen2Tokenizer"
    assert type(loaded).__name__ == ("Qwen3_5Tokenizer" if qwen3_5 else "Qwen2Tokenizer")
    built = build_tokenizer(
        QWEN2_VL_SPECIAL_TOKENS,
        named_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        added_tokens=QWEN3_ADDED_TOKENS,
        pretokenize_regex=QWEN3_5_PRETOKENIZE_REGEX if qwen3_5 else PRETOKENIZE_REGEX,
    )
    for text in TEXTS:
        assert loaded(text).input_ids == built(text).input_ids, text
    order = [*QWEN2_VL_SPECIAL_TOKENS, *QWEN3_ADDED_TOKENS]
    ids = loaded.convert_tokens_to_ids(order)
    assert ids == list(range(ids[0], ids[0] + len(order)))
    assert set(QWEN2_VL_SPECIAL_TOKENS) <= set(loaded.all_special_tokens)
    assert not set(QWEN3_ADDED_TOKENS) & set(loaded.all_special_tokens)
    assert loaded.tokenize("a<think>b") == ["a", "<think>", "b"]


def test_the_chat_templates_render_the_families_prompts(written: Any) -> None:
    variant, _, folder = written
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Why?"}]},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    turns = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|video_pad|><|vision_end|>Why?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == turns + ("<think>\n" if variant.startswith("qwen3_5") else "")
    numbered = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}]}],
        tokenize=False,
        add_vision_id=True,
    )
    assert "Picture 1: <|vision_start|>" in numbered and "Video 1: <|vision_start|>" in numbered


def test_the_folder_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="variant"):
        write_qwen3_vl_folder(tmp_path, variant="qwen2_vl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout"):
        write_qwen3_vl_folder(tmp_path, layout="flat")  # type: ignore[arg-type]
