"""The paddleocr_vl plugin's demo model: a tiny PaddleOCR-VL folder, no weights, no hub.

``write_paddleocr_vl_folder`` writes a folder with PaddleOCR-VL's real special tokens (a small
byte-level BPE tokenizer made by :func:`mmproc.testing.build_tokenizer`), its real preprocessor
settings as the hub publishes them and its chat template's rendering.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from mmproc.plugin import build_tokenizer, resave_with_processor, write_model_folder

__all__ = [
    "PADDLEOCR_VL_CHAT_TEMPLATE",
    "PADDLEOCR_VL_SPECIAL_TOKENS",
    "write_paddleocr_vl_demo",
    "write_paddleocr_vl_folder",
]

# The ERNIE-4.5 tokenizer's special tokens PaddleOCR-VL uses: the SentencePiece basics, the
# sentence markers (cls / sep), and the vision markers; real ids are 100295 (image placeholder),
# 100296 (video placeholder), 101305 / 101306 (image start / end).
PADDLEOCR_VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "<|begin_of_sentence|>",
    "<|end_of_sentence|>",
    "<mask:1>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|VIDEO_PLACEHOLDER|>",
    "<|IMAGE_START|>",
    "<|IMAGE_END|>",
    "<|VIDEO_START|>",
    "<|VIDEO_END|>",
    "<think>",
    "</think>",
)

# Renders the same prompt text as the PaddleOCR-VL hub template: every image of a user turn first
# (`<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>`), then its text, and "Assistant:\n".
PADDLEOCR_VL_CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}"
    "{%- endif -%}"
    "{{- '<|begin_of_sentence|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{- part['text'] + '\n' -}}"
    "{%- endfor -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- 'User: ' -}}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}"
    "{{- '<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>' -}}"
    "{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endfor -%}"
    "{{- '\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- 'Assistant:\n' -}}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endfor -%}"
    "{{- '</s>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:\n' -}}{%- endif -%}"
)

# The hub's PaddleOCR-VL preprocessor_config.json (without its remote-code auto_map).
_PADDLEOCR_VL_PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "PaddleOCRVLImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_pixels": 2822400,
    "merge_size": 2,
    "min_pixels": 147384,
    "patch_size": 14,
    "processor_class": "PaddleOCRVLProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "temporal_patch_size": 1,
}


def write_paddleocr_vl_folder(
    path: str | Path,
    *,
    layout: Literal["hub", "save_pretrained"] = "hub",
    chat_template_file: Literal["json", "jinja"] = "jinja",
) -> Path:
    """Write a tiny PaddleOCR-VL folder with the real tokens and preprocessor settings.

    Settings: patch 14, merge 2, temporal patch 1, ``min_pixels`` 147384, ``max_pixels`` 2822400,
    mean / std 0.5, bicubic (resample 3), rescale 1/255. The tokenizer names
    ``image_token = "<|IMAGE_PLACEHOLDER|>"`` (``PaddleOCRVLProcessor`` reads
    ``tokenizer.image_token``); ``tokenizer_config.json`` says ``LlamaTokenizer`` as the hub
    does, which transformers overrides for this model type and loads ``tokenizer.json`` as is.

    Args:
        path: The folder to write.
        layout: ``"hub"`` or ``"save_pretrained"`` (``PaddleOCRVLProcessor.save_pretrained``'s
            output after loading the hub folder, plus ``config.json``).
        chat_template_file: Chat template file of the hub layout (the hub has ``.jinja``).
    """
    if layout not in ("hub", "save_pretrained"):
        raise ValueError(f"layout must be 'hub' or 'save_pretrained', not {layout!r}")
    if layout == "save_pretrained":
        with tempfile.TemporaryDirectory(prefix="mmproc-paddle-hub-") as hub:
            write_paddleocr_vl_folder(hub, layout="hub")
            return resave_with_processor(Path(hub), Path(path))

    tokenizer = build_tokenizer(
        PADDLEOCR_VL_SPECIAL_TOKENS,
        named_tokens={
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<unk>",
            "cls_token": "<|begin_of_sentence|>",
            "sep_token": "<|end_of_sentence|>",
            "mask_token": "<mask:1>",
            "image_token": "<|IMAGE_PLACEHOLDER|>",
            "image_start_token": "<|IMAGE_START|>",
            "image_end_token": "<|IMAGE_END|>",
            "video_token": "<|VIDEO_PLACEHOLDER|>",
            "video_start_token": "<|VIDEO_START|>",
            "video_end_token": "<|VIDEO_END|>",
        },
        model_max_length=131072,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in PADDLEOCR_VL_SPECIAL_TOKENS}
    extra_config = {
        "image_token_id": ids["<|IMAGE_PLACEHOLDER|>"],
        "video_token_id": ids["<|VIDEO_PLACEHOLDER|>"],
        "vision_start_token_id": ids["<|IMAGE_START|>"],
        "vision_end_token_id": ids["<|IMAGE_END|>"],
        "pad_token_id": ids["<unk>"],
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "vocab_size": len(tokenizer),
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "num_channels": 3},
    }
    return write_model_folder(
        path,
        architecture="PaddleOCRVLForConditionalGeneration",
        model_type="paddleocr_vl",
        tokenizer=tokenizer,
        preprocessor_config=_PADDLEOCR_VL_PREPROCESSOR,
        chat_template=PADDLEOCR_VL_CHAT_TEMPLATE,
        chat_template_file=chat_template_file,
        extra_config=extra_config,
        tokenizer_config={"tokenizer_class": "LlamaTokenizer", "add_bos_token": False},
    )


def write_paddleocr_vl_demo(folder: Path) -> Path:
    """The ``paddleocr-vl`` demo model (hub layout)."""
    return write_paddleocr_vl_folder(folder)
