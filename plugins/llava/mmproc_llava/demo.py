"""The llava plugin's demo models: tiny LLaVA-OneVision, LLaVA-NeXT and LLaVA-NeXT-Video
folders, no weights, no hub.

Each is written with its checkpoint's real special tokens (a small byte-level BPE tokenizer from
:func:`mmproc.plugin.build_tokenizer`; Llama-style ones add a BOS token, as theirs do), the hub
folder's image, video and processor settings and its chat template:

* ``llava-onevision``: ``llava-hf/llava-onevision-qwen2-0.5b-ov-hf``: SigLIP tiles of 384, the
  36 canvases up to 2304 x 2304, mean and std 0.5, 729 tokens per tile, ``anyres_max_9``;
* ``llava-next``: ``llava-hf/llava-v1.6-mistral-7b-hf``: CLIP tiles of 336 (shortest edge 336,
  center crop), five canvases up to 1008, a CLS feature dropped (``default`` strategy);
* ``llava-next-video``: ``llava-hf/LLaVA-NeXT-Video-7B-hf``: LLaVA-NeXT's images, and frames
  cropped to 336 and pooled 2 x 2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from mmproc.plugin import build_tokenizer, resave_with_processor, write_model_folder

__all__ = [
    "NEXT_PINPOINTS",
    "ONEVISION_PINPOINTS",
    "write_llava_folder",
    "write_next_demo",
    "write_next_video_demo",
    "write_onevision_demo",
]

Variant = Literal["onevision", "next", "next_video"]

ONEVISION_PINPOINTS = [[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)]
"""LLaVA-OneVision's canvases: every grid of 1 to 6 by 1 to 6 tiles of 384."""
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
"""LLaVA-NeXT's (and LLaVA-NeXT-Video's) canvases."""

_SIGLIP = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
_CLIP = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
_ALWAYS = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}
_CLIP_336 = {
    **_CLIP,
    "size": {"shortest_edge": 336},
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
}

# LLaVA-NeXT-Video's processor and config say what LLaVA-NeXT's do about images.
_NEXT_PROCESSOR = {
    "patch_size": 14,
    "vision_feature_select_strategy": "default",
    "num_additional_image_tokens": 1,
}
_NEXT_CONFIG = {
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "image_grid_pinpoints": NEXT_PINPOINTS,
    "vision_config": {"model_type": "clip_vision_model", "image_size": 336},
}

# Images first, then videos, then the text of each turn, as the hub templates render them.
_ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' + content['text'] }}{% endfor %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_MISTRAL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{ ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'][0]['text'] + '</s> ' }}"
    "{% endif %}{% endfor %}"
)
_VICUNA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Per variant: architecture, model_type, the tokenizer's special tokens (in id order) and named
# tokens, the files' settings, the chat template.
_VARIANTS: dict[str, dict[str, Any]] = {
    "onevision": {
        "architecture": "LlavaOnevisionForConditionalGeneration",
        "model_type": "llava_onevision",
        "specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"),
        "named": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "bos": False,
        "image": {
            **_SIGLIP,
            "image_processor_type": "LlavaOnevisionImageProcessor",
            "size": {"height": 384, "width": 384},
            "image_grid_pinpoints": ONEVISION_PINPOINTS,
        },
        "video": {
            **_SIGLIP,
            "video_processor_type": "LlavaOnevisionVideoProcessor",
            "size": {"height": 384, "width": 384},
        },
        "processor": {
            "processor_class": "LlavaOnevisionProcessor",
            "num_image_tokens": 729,
            "vision_feature_select_strategy": "full",
            "vision_aspect_ratio": "anyres_max_9",
        },
        "config": {
            "vision_feature_select_strategy": "full",
            "vision_feature_layer": -1,
            "vision_aspect_ratio": "anyres_max_9",
            "image_grid_pinpoints": ONEVISION_PINPOINTS,
            "vision_config": {"model_type": "siglip_vision_model", "image_size": 384},
            "text_config": {"model_type": "qwen2"},
        },
        "template": _ONEVISION_TEMPLATE,
    },
    "next": {
        "architecture": "LlavaNextForConditionalGeneration",
        "model_type": "llava_next",
        "specials": ("<unk>", "<s>", "</s>", "<image>", "<pad>"),
        "named": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "bos": True,
        "image": {
            **_CLIP_336,
            "image_processor_type": "LlavaNextImageProcessor",
            "image_grid_pinpoints": NEXT_PINPOINTS,
            "aspect_ratio_setting": "anyres",
        },
        "video": None,
        "processor": {**_NEXT_PROCESSOR, "processor_class": "LlavaNextProcessor"},
        "config": {**_NEXT_CONFIG, "text_config": {"model_type": "mistral"}},
        "template": _MISTRAL_TEMPLATE,
    },
    "next_video": {
        "architecture": "LlavaNextVideoForConditionalGeneration",
        "model_type": "llava_next_video",
        "specials": ("<unk>", "<s>", "</s>", "<video>", "<image>"),
        "named": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "bos": True,
        "image": {
            **_CLIP_336,
            "image_processor_type": "LlavaNextImageProcessor",
            "image_grid_pinpoints": NEXT_PINPOINTS,
        },
        "video": {**_CLIP_336, "video_processor_type": "LlavaNextVideoVideoProcessor"},
        "processor": {**_NEXT_PROCESSOR, "processor_class": "LlavaNextVideoProcessor"},
        "config": {
            **_NEXT_CONFIG,
            "spatial_pool_mode": "average",
            "spatial_pool_stride": 2,
            "text_config": {"model_type": "llama"},
        },
        "template": _VICUNA_TEMPLATE,
    },
}


def write_llava_folder(
    path: str | Path, variant: Variant, *, layout: Literal["hub", "save_pretrained"] = "hub"
) -> Path:
    """Write a tiny folder of one LLaVA family with its checkpoint's real tokens and settings.

    Args:
        path: The folder to write.
        variant: ``"onevision"``, ``"next"`` or ``"next_video"``.
        layout: ``"hub"``: the files as the hub repository has them; ``"save_pretrained"``: what
            the processor's ``save_pretrained`` writes after loading the hub folder, plus
            ``config.json``.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {sorted(_VARIANTS)}, not {variant!r}")
    if layout == "save_pretrained":
        with tempfile.TemporaryDirectory(prefix="mmproc-llava-hub-") as hub:
            write_llava_folder(hub, variant)
            return resave_with_processor(Path(hub), Path(path))
    if layout != "hub":
        raise ValueError(f"layout must be 'hub' or 'save_pretrained', not {layout!r}")
    spec = _VARIANTS[variant]
    media = {"image_token": "<image>"}
    if spec["video"] is not None:
        media["video_token"] = "<video>"
    tokenizer = build_tokenizer(
        spec["specials"], named_tokens={**spec["named"], **media}, add_bos_token=spec["bos"]
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in spec["specials"]}
    processor_class = spec["processor"]["processor_class"]
    video = spec["video"]
    config = {**spec["config"], "image_token_index": ids["<image>"]}
    config["text_config"] = {**config["text_config"], "vocab_size": len(tokenizer)}
    if video is not None:
        config["video_token_index"] = ids["<video>"]
    return write_model_folder(
        path,
        architecture=spec["architecture"],
        model_type=spec["model_type"],
        tokenizer=tokenizer,
        preprocessor_config={
            **_ALWAYS,
            **spec["image"],
            "processor_class": processor_class,
            "resample": 3,
            "do_pad": True,
            "do_convert_rgb": True,
        },
        processor_config={**spec["processor"], **media},
        video_preprocessor_config=None
        if video is None
        else {**_ALWAYS, **video, "processor_class": processor_class, "resample": 3},
        chat_template=spec["template"],
        extra_config=config,
    )


def write_onevision_demo(folder: Path) -> Path:
    """The ``llava-onevision`` demo model."""
    return write_llava_folder(folder, "onevision")


def write_next_demo(folder: Path) -> Path:
    """The ``llava-next`` demo model."""
    return write_llava_folder(folder, "next")


def write_next_video_demo(folder: Path) -> Path:
    """The ``llava-next-video`` demo model."""
    return write_llava_folder(folder, "next_video")
