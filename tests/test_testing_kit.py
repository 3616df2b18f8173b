"""mmproc.testing: tokenizers and model folders for any model, loaded by transformers, offline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mmproc.testing
import pytest
from mmproc.testing import build_tokenizer, write_model_folder
from transformers import (
    AutoConfig,
    AutoProcessor,
    AutoTokenizer,
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>")
TEXTS = [
    "Hello world! What's in this picture?",
    "  two spaces,\n\nnew lines, digits 12345 and ünïcödé 汉字 😀",
    "the cat sat on the mat<|im_end|>",
]


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
    one = build_tokenizer(SPECIAL_TOKENS)
    two = build_tokenizer(SPECIAL_TOKENS)
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


# --- build_tokenizer: a BOS like Llama's ----------------------------------------------------


def test_a_bos_adding_tokenizer_starts_every_call_with_bos_and_keeps_it_saved(
    tmp_path: Path,
) -> None:
    tokenizer = build_tokenizer(
        ["<s>", "</s>", "<image>"],
        named_tokens={"bos_token": "<s>", "eos_token": "</s>"},
        add_bos_token=True,
    )
    bos = tokenizer.convert_tokens_to_ids("<s>")
    assert tokenizer("hello <image>").input_ids[0] == bos
    assert bos not in tokenizer("hello <image>", add_special_tokens=False).input_ids
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded("hello <image>").input_ids == tokenizer("hello <image>").input_ids
    with pytest.raises(ValueError, match="needs a bos_token"):
        build_tokenizer([], add_bos_token=True)


# --- probes ---------------------------------------------------------------------------------


class _Part:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return "ran"


class _Processor:
    def __init__(self) -> None:
        self.image_processor = _Part()
        self.tokenizer = _Part()


def test_links_to_original_finds_closures_and_foreign_bound_methods() -> None:
    import copy
    import types

    from mmproc.testing.probes import links_to_original

    original = _Processor()
    part = original.image_processor
    original.image_processor.filtered = lambda: part()  # a closure over the original part
    original.bound = types.MethodType(lambda self: self, original)  # rebinds on deepcopy
    clone = copy.deepcopy(original)
    clone.stray = original.tokenizer.__call__  # bound to the original after the copy
    findings = links_to_original(original, clone)
    assert len(findings) == 2, findings
    assert any("processor.image_processor.filtered" in f and "closure" in f for f in findings)
    assert any("processor.stray" in f and "bound to the original" in f for f in findings)
    assert links_to_original(_Processor(), copy.deepcopy(_Processor())) == []


def test_poisoned_parts_raise_when_used_and_come_back_afterwards() -> None:
    from mmproc.testing.probes import poisoned

    class Model:
        def __init__(self) -> None:
            self.stored = _Processor()

    model, processor = Model(), _Processor()
    with poisoned(processor, model, what="the original"):
        with pytest.raises(AssertionError, match=r"the original\.tokenizer was used"):
            processor.tokenizer()
        with pytest.raises(AssertionError, match=r"the original\.stored\.image_processor"):
            model.stored.image_processor()
    assert processor.tokenizer() == "ran" and model.stored.image_processor() == "ran"


def test_heavy_imports_lists_what_an_import_pulls_in() -> None:
    from mmproc.testing.probes import heavy_imports

    assert heavy_imports("mmproc_qwen_vl.plugin") == []
    assert "torch" in heavy_imports("mmproc_qwen_vl.model")
