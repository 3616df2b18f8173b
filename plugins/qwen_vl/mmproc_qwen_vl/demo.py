"""The qwen_vl plugin's demo models: tiny Qwen2-VL / Qwen2.5-VL folders, no weights, no hub.

``write_qwen2_vl_folder`` writes a folder with Qwen2-VL's real special tokens (a small byte-level
BPE tokenizer made by :func:`mmproc.testing.build_tokenizer`), the real preprocessor settings as
the hub publishes them (quirks included) and the real chat template's rendering. It is what
``mmproc demo --model demo:qwen2-vl`` runs on, and what this plugin's tests and the core's
pipeline tests build their folders with.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from mmproc.plugin import build_tokenizer, resave_with_processor, write_model_folder

# AutoTokenizer rebuilds a Qwen2 tokenizer's pipeline from the vocabulary and merges with this
# regex (ignoring the pre-tokenizer stored in tokenizer.json), so the demo's uses the very same.
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

__all__ = [
    "QWEN2_5_VL_ADDED_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN2_VL_SPECIAL_TOKENS",
    "write_qwen2_5_vl_demo",
    "write_qwen2_vl_demo",
    "write_qwen2_vl_folder",
]

# In the order of their ids in the real vocabulary (151643 ... 151656).
QWEN2_VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2.5-VL's vocabulary adds these after the special tokens, as added tokens that are NOT special
# (they survive `skip_special_tokens` decoding), ids 151657 ... 151664.
QWEN2_5_VL_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)

# Renders the same prompt text as the Qwen2-VL / Qwen2.5-VL hub template: a default system turn,
# ChatML turns, and one `<|vision_start|><|image_pad|><|vision_end|>` per image (the processor then
# expands the single `<|image_pad|>` to the image's token count). No whitespace control: the
# string has no stray whitespace, and every newline in it is part of the prompt.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The settings of the hub's Qwen2-VL-*-Instruct preprocessor_config.json (Qwen2.5-VL's differ
# only in the class names). The resampling filter is not in the file: the class default, bicubic.
_QWEN2_VL_PREPROCESSOR: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

_QWEN_VARIANTS: dict[str, dict[str, str]] = {
    "qwen2_vl": {
        "architecture": "Qwen2VLForConditionalGeneration",
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    },
    "qwen2_5_vl": {
        "architecture": "Qwen2_5_VLForConditionalGeneration",
        # Some hub Qwen2.5-VL folders name "Qwen2_5_VLImageProcessor", a class transformers does
        # not have: its Auto classes then raise "Unrecognized image processor" (5.24), unless
        # AutoImageProcessor is given the model config. Written only when asked for.
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    },
}


def write_qwen2_vl_folder(
    path: str | Path,
    *,
    variant: Literal["qwen2_vl", "qwen2_5_vl"] = "qwen2_vl",
    layout: Literal["hub", "save_pretrained"] = "hub",
    image_processor_type: str | None = None,
    chat_template_file: Literal["json", "jinja"] = "json",
) -> Path:
    """Write a tiny Qwen2-VL (or Qwen2.5-VL) folder with the real tokens and preprocessor settings.

    Settings: patch 14, merge 2, temporal patch 2, ``min_pixels`` 3136, ``max_pixels`` 12845056,
    CLIP mean / std, bicubic resampling (the class default; the hub file does not name it).

    Args:
        path: The folder to write.
        variant: ``"qwen2_vl"`` or ``"qwen2_5_vl"`` (architecture, processor class, and the
            non-special tool / FIM tokens Qwen2.5 adds).
        layout: ``"hub"``: the files as the hub repository has them (``preprocessor_config.json``
            with ``min_pixels`` / ``max_pixels``, ``chat_template.json``). ``"save_pretrained"``:
            what ``Qwen2VLProcessor.save_pretrained`` writes after loading the hub folder
            (``processor_config.json`` holding the image and video processors, ``size`` instead
            of min / max pixels, ``chat_template.jinja``), plus the model's ``config.json``.
        image_processor_type: Overrides ``image_processor_type`` in ``preprocessor_config.json``,
            e.g. ``"Qwen2_5_VLImageProcessor"``, the name the hub's Qwen2.5-VL folders carry,
            which transformers has no class for.
        chat_template_file: Chat template file of the hub layout.
    """
    if variant not in _QWEN_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(_QWEN_VARIANTS)}, not {variant!r}")
    if layout not in ("hub", "save_pretrained"):
        raise ValueError(f"layout must be 'hub' or 'save_pretrained', not {layout!r}")
    names = _QWEN_VARIANTS[variant]

    if layout == "save_pretrained":
        with tempfile.TemporaryDirectory(prefix="mmproc-qwen-hub-") as hub:
            write_qwen2_vl_folder(
                hub, variant=variant, layout="hub", image_processor_type=image_processor_type
            )
            return resave_with_processor(Path(hub), Path(path))

    tokenizer = build_tokenizer(
        QWEN2_VL_SPECIAL_TOKENS,
        named_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        added_tokens=QWEN2_5_VL_ADDED_TOKENS if variant == "qwen2_5_vl" else (),
        pretokenize_regex=PRETOKENIZE_REGEX,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2_VL_SPECIAL_TOKENS}
    vision_config: dict[str, Any] = {
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_chans": 3,
    }
    if variant == "qwen2_5_vl":
        vision_config["tokens_per_second"] = 2
    extra_config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vocab_size": len(tokenizer),
        "vision_config": vision_config,
    }
    preprocessor = {
        **_QWEN2_VL_PREPROCESSOR,
        "image_processor_type": image_processor_type or names["image_processor_type"],
        "processor_class": names["processor_class"],
    }
    return write_model_folder(
        path,
        architecture=names["architecture"],
        model_type=variant,
        tokenizer=tokenizer,
        preprocessor_config=preprocessor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
        chat_template_file=chat_template_file,
        extra_config=extra_config,
        tokenizer_config={
            "tokenizer_class": "Qwen2Tokenizer",
            "errors": "replace",
            "split_special_tokens": False,
            "bos_token": None,
            "unk_token": None,
            "add_prefix_space": False,
        },
    )


def write_qwen2_vl_demo(folder: Path) -> Path:
    """The ``qwen2-vl`` demo model (hub layout)."""
    return write_qwen2_vl_folder(folder)


def write_qwen2_5_vl_demo(folder: Path) -> Path:
    """The ``qwen2.5-vl`` demo model (hub layout)."""
    return write_qwen2_vl_folder(folder, variant="qwen2_5_vl")
