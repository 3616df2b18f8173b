"""mmproc.testing: the tiny model folders load with transformers' Auto classes, offline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mmproc.testing
import numpy as np
import pytest
from mmproc.testing import (
    PADDLEOCR_VL_SPECIAL_TOKENS,
    QWEN2_5_VL_ADDED_TOKENS,
    QWEN2_VL_SPECIAL_TOKENS,
    build_tokenizer,
    write_model_folder,
    write_paddleocr_vl_folder,
    write_qwen2_vl_folder,
)
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
)

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


# --- build_tokenizer ------------------------------------------------------------------------


def test_each_special_token_is_one_id_even_between_words() -> None:
    tokenizer = build_tokenizer(["<|a|>", "<|image_pad|>"], named_tokens={"eos_token": "<|end|>"})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ["<|a|>", "<|image_pad|>", "<|end|>"]}
    assert len(set(ids.values())) == 3
    assert sorted(ids.values()) == list(range(len(tokenizer) - 3, len(tokenizer)))
    encoded = tokenizer("cat<|image_pad|><|image_pad|>dog <|a|>x<|end|>").input_ids
    assert encoded.count(ids["<|image_pad|>"]) == 2
    assert encoded.count(ids["<|a|>"]) == 1
    assert tokenizer.eos_token == "<|end|>" and tokenizer.eos_token_id == ids["<|end|>"]


def test_bpe_learns_merges_and_tokenises_any_text() -> None:
    tokenizer = build_tokenizer([])
    vocab = tokenizer.get_vocab()
    assert len(vocab) > 256 + 50  # merges beyond the byte alphabet
    assert "Ġthe" in vocab  # a merge across the space before a word, byte-level style
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
    assert len(tokenizer("the picture").input_ids) < len(b"the picture")


def test_the_tokenizer_is_deterministic() -> None:
    one = build_tokenizer(QWEN2_VL_SPECIAL_TOKENS)
    two = build_tokenizer(QWEN2_VL_SPECIAL_TOKENS)
    assert one.get_vocab() == two.get_vocab()
    assert one.backend_tokenizer.to_str() == two.backend_tokenizer.to_str()


def test_named_and_added_tokens() -> None:
    tokenizer = build_tokenizer(
        ["<|x|>"], named_tokens={"image_token": "<|img|>"}, added_tokens=["<tool>"]
    )
    assert tokenizer.image_token == "<|img|>"
    assert tokenizer.image_token_id == tokenizer.convert_tokens_to_ids("<|img|>")
    tool = tokenizer.convert_tokens_to_ids("<tool>")
    assert tokenizer("a<tool>b").input_ids.count(tool) == 1
    # an added token that is not special survives skip_special_tokens
    assert (
        tokenizer.decode(tokenizer("<tool><|x|>").input_ids, skip_special_tokens=True) == "<tool>"
    )
    with pytest.raises(ValueError, match="end in '_token'"):
        build_tokenizer([], named_tokens={"image": "<|img|>"})
    with pytest.raises(ValueError, match="both special and non-special"):
        build_tokenizer(["<tool>"], added_tokens=["<tool>"])


# --- write_model_folder ---------------------------------------------------------------------


@pytest.mark.parametrize("template_file", ["json", "jinja"])
def test_write_model_folder_writes_the_hub_layout(tmp_path: Path, template_file: str) -> None:
    tokenizer = build_tokenizer(["<|image_pad|>"], named_tokens={"eos_token": "<|end|>"})
    folder = write_model_folder(
        tmp_path / "model",
        architecture="Qwen2VLForConditionalGeneration",
        model_type="qwen2_vl",
        tokenizer=tokenizer,
        preprocessor_config={"image_processor_type": "Qwen2VLImageProcessor"},
        processor_config={"processor_class": "Qwen2VLProcessor"},
        chat_template="{{ messages[0]['content'] }}",
        chat_template_file=template_file,  # type: ignore[arg-type]
        extra_config={"image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>")},
        video_preprocessor_config={"video_processor_type": "Qwen2VLVideoProcessor"},
        tokenizer_config={"tokenizer_class": "Qwen2Tokenizer"},
    )
    files = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        f"chat_template.{template_file}",
    } <= files
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["model_type"] == "qwen2_vl"
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (
        AutoConfig.from_pretrained(folder, local_files_only=True).image_token_id
        == (config["image_token_id"])
    )
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert load(folder).chat_template == "{{ messages[0]['content'] }}"
    # the tokenizer reads chat_template.jinja only; chat_template.json is the processor's file
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    expected = "{{ messages[0]['content'] }}" if template_file == "jinja" else None
    assert loaded.chat_template == expected
    with pytest.raises(ValueError, match="chat_template_file"):
        write_model_folder(
            tmp_path / "bad",
            architecture="A",
            model_type="qwen2_vl",
            tokenizer=tokenizer,
            preprocessor_config={},
            chat_template_file="yaml",  # type: ignore[arg-type]
        )


# --- Qwen2-VL / Qwen2.5-VL ------------------------------------------------------------------

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


# --- PaddleOCR-VL ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["hub", "save_pretrained"])
def paddle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paddleocr_vl_folder(
        tmp_path_factory.mktemp(f"paddle-{request.param}"), layout=request.param
    )


@pytest.mark.parametrize("backend", [None, "pil"])
def test_paddleocr_vl_folder_loads_and_expands_the_placeholder(
    paddle: Path, backend: str | None
) -> None:
    processor = load(paddle, **({} if backend is None else {"backend": backend}))
    assert type(processor).__name__ == "PaddleOCRVLProcessor"
    expected_ip = (
        "PaddleOCRVLImageProcessorPil" if backend == "pil" else "PaddleOCRVLImageProcessor"
    )
    assert type(processor.image_processor).__name__ == expected_ip
    ip = processor.image_processor
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 1)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (147384, 2822400)
    assert list(ip.image_mean) == [0.5] * 3 and list(ip.image_std) == [0.5] * 3
    assert int(ip.resample) == 3

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "OCR:"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_sentence|>User: <|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>OCR:\n"
        "Assistant:\n"
    )
    out = processor(text=[text], images=[image(90, 60)])
    grid = np.asarray(out["image_grid_thw"])
    # 90x60 is grown to the 147384-pixel minimum: 476 x 336 pixels, 34 x 24 patches
    assert grid.tolist() == [[1, 24, 34]]
    assert np.asarray(out["pixel_values"]).shape == (24 * 34, 3, 14, 14)
    config = AutoConfig.from_pretrained(paddle, local_files_only=True)
    assert processor.image_token == "<|IMAGE_PLACEHOLDER|>"
    assert processor.image_token_id == config.image_token_id
    ids = list(out["input_ids"][0])
    assert ids.count(config.image_token_id) == 24 * 34 // 4
    assert ids.count(config.vision_start_token_id) == 1
    assert ids.count(config.vision_end_token_id) == 1


def test_paddleocr_vl_tokenizer_keeps_the_special_tokens_whole(paddle: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(paddle, local_files_only=True)
    for token in PADDLEOCR_VL_SPECIAL_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert tokenizer(f"x{token}y", add_special_tokens=False).input_ids.count(token_id) == 1
    assert tokenizer.image_token == "<|IMAGE_PLACEHOLDER|>"
    assert tokenizer.cls_token == "<|begin_of_sentence|>"
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<unk>"


# --- the package ----------------------------------------------------------------------------


def test_public_api_is_sorted_and_documented() -> None:
    names = mmproc.testing.__all__
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
    for name in names:
        value = getattr(mmproc.testing, name)
        if callable(value):
            assert value.__doc__, name


def test_import_mmproc_does_not_import_the_kit_or_transformers() -> None:
    code = (
        "import sys, mmproc; "
        "names = ('transformers', 'tokenizers', 'mmproc.testing'); "
        "heavy = [m for m in names if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
