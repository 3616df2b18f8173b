"""The sarashina2 plugin's demo model: a tiny Sarashina2-Vision folder, no weights, no hub.

What it carries of the real model (sbintuitions/sarashina2-vision-8b): ``config.json``'s keys
(``model_type`` ``sarashina2_vision``, which transformers does not know, the image marker ids
``image_token_index`` / ``start_image_token_index`` / ``end_image_token_index``, the Qwen2-VL
vision settings); the tokenizer's special tokens (``<unk>``, ``<s>``, ``</s>``, ``<pad>``,
``<sep>``, ``<mask>``, ``<|file|>``, ``<|prefix|>``, ``<|suffix|>``; no BOS added by the tokenizer,
the chat template writes ``<s>`` itself); the chat format (``<s>``, one
``<|prefix|><|file|><|suffix|>`` per image, the system sentence, ``### Human:`` /
``### Assistant:``). The image processor settings are those of the related
sbintuitions/sarashina2.2-ocr, the family's published ``preprocessor_config.json`` (mean and std
0.5, ``min_pixels`` 3136, ``max_pixels`` 2458624, bilinear resampling, patch 14, merge 2, temporal
patch 2): the 8b folder's own file was not available to us. A real folder's values are read from
its files; none of these is used outside the demo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmproc.plugin import build_tokenizer, write_model_folder

__all__ = ["CHAT_TEMPLATE", "PREPROCESSOR", "SPECIAL_TOKENS", "write_demo_folder"]

SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<sep>",
    "<mask>",
    "<|file|>",
    "<|prefix|>",
    "<|suffix|>",
)

PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Sarashina2VisionImageProcessor",
    "processor_class": "Sarashina2VisionProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 3136,
    "max_pixels": 2458624,
    "size": {"longest_edge": 2458624, "shortest_edge": 3136},
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
}

# Renders the documented prompt: the image block right after <s>, once per image part.
CHAT_TEMPLATE = (
    "<s>"
    "{% for message in messages %}{% if message['content'] is not string %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|prefix|><|file|><|suffix|>"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "A chat between a curious human and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the human's questions.\n\n"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}### Human: {% else %}### Assistant: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:{% endif %}"
)


def write_demo_folder(folder: Path) -> Path:
    """Write the demo model into ``folder`` and return it."""
    tokenizer = build_tokenizer(
        SPECIAL_TOKENS,
        named_tokens={
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "sep_token": "<sep>",
            "mask_token": "<mask>",
        },
        model_max_length=4096,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    return write_model_folder(
        folder,
        architecture="Sarashina2VisionForCausalLM",
        model_type="sarashina2_vision",
        tokenizer=tokenizer,
        preprocessor_config=PREPROCESSOR,
        chat_template=CHAT_TEMPLATE,
        extra_config={
            "image_token_index": ids["<|file|>"],
            "start_image_token_index": ids["<|prefix|>"],
            "end_image_token_index": ids["<|suffix|>"],
            "text_config": {
                "model_type": "llama",
                "max_position_embeddings": 4096,
                "vocab_size": len(tokenizer),
            },
            "vision_config": {
                "model_type": "qwen2_vl",
                "in_chans": 3,
                "spatial_patch_size": 14,
                "hidden_size": 4096,
            },
        },
    )
