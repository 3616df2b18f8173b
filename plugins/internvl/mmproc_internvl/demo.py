"""The internvl plugin's demo model: a tiny InternVL3-1B-hf folder, no weights, no hub.

:func:`write_internvl3_folder` writes InternVL3's real special tokens (a small byte-level BPE
tokenizer made by :func:`mmproc.plugin.build_tokenizer`, with Qwen2's pre-tokenizer, as
InternVL3-1B's language model is Qwen2.5's), the hub folder's image, video and processor
settings (448-pixel tiles, 1 to 12 of them, ImageNet mean and std, bicubic, 256 tokens per tile)
and its chat template. It is what ``mmproc demo --model demo:internvl3`` runs on and what the
plugin's tests build their folders with.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from mmproc.plugin import build_tokenizer, resave_with_processor, write_model_folder
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

__all__ = [
    "INTERNVL3_CHAT_TEMPLATE",
    "INTERNVL3_SPECIAL_TOKENS",
    "write_internvl3_demo",
    "write_internvl3_folder",
]

# In the order of their ids in InternVL3-1B-hf's vocabulary: Qwen2.5's, then InternVL's own
# (<img> is 151665).
INTERNVL3_SPECIAL_TOKENS: tuple[str, ...] = tuple(
    """
    <|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|>
    <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|>
    <|image_pad|> <|video_pad|> <img> </img> <IMG_CONTEXT> <quad> </quad> <ref> </ref> <box> </box>
    <video>
    """.split()
)

# The real template: a default system turn (InternVL's Chinese self-description), ChatML turns,
# each image part as <IMG_CONTEXT> and each video part as <video>, each on a line of its own.
INTERNVL3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及"
    "多家合作单位联合开发的多模态大语言模型。<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The demo tokenizer's training words: everyday prompt words, and "Frame", which InternVL writes
# before each video frame (the real vocabulary has " Frame" as one token, so the demo's learns the
# word and merges it with a space before it, as the real one does).
_WORDS = tuple(
    """
    the a an and or of to in on at with from is are was be this that what which who where when
    how why not all some many one two three first last next more most here there now then also
    picture image photo video frame Frame Frame Frame describe look see show tell read count
    compare cat dog bird car street house room table book text word sign red green blue black
    white big small left right top bottom man woman people face hand sky tree water day night
    hello please thank thanks yes no answer question it's don't there's
    """.split()
)

# What the hub folder's image and video processors both say: 448 x 448, bicubic, ImageNet
# mean and std.
_COMMON: dict[str, Any] = {
    "processor_class": "InternVLProcessor",
    "size": {"height": 448, "width": 448},
    "resample": 3,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "do_convert_rgb": True,
}

# preprocessor_config.json of OpenGVLab/InternVL3-1B-hf. It says crop_to_patches: false, but
# InternVLProcessor's own default (crop_to_patches on) wins at every call, so images are tiled.
_PREPROCESSOR: dict[str, Any] = {
    **_COMMON,
    "image_processor_type": "GotOcr2ImageProcessorFast",
    "crop_to_patches": False,
    "min_patches": 1,
    "max_patches": 12,
    "default_to_square": True,
}

_VIDEO_PREPROCESSOR: dict[str, Any] = {
    **_COMMON,
    "video_processor_type": "InternVLVideoProcessor",
    "initial_shift": True,
}


def write_internvl3_folder(
    path: str | Path,
    *,
    layout: Literal["hub", "save_pretrained"] = "hub",
    max_patches: int = 12,
) -> Path:
    """Write a tiny InternVL3-1B-hf folder with the real tokens, settings and chat template.

    Args:
        path: The folder to write.
        layout: ``"hub"``: the files as the hub repository has them; ``"save_pretrained"``: what
            ``InternVLProcessor.save_pretrained`` writes after loading the hub folder
            (``processor_config.json`` holding the image and video processors), plus
            ``config.json``.
        max_patches: The folder's tile limit (the hub's is 12).
    """
    if layout == "save_pretrained":
        with tempfile.TemporaryDirectory(prefix="mmproc-internvl-hub-") as hub:
            write_internvl3_folder(hub, max_patches=max_patches)
            return resave_with_processor(Path(hub), Path(path))
    if layout != "hub":
        raise ValueError(f"layout must be 'hub' or 'save_pretrained', not {layout!r}")
    tokenizer = build_tokenizer(
        INTERNVL3_SPECIAL_TOKENS,
        words=_WORDS,
        named_tokens={
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        added_tokens=("<tool_call>", "</tool_call>"),
        pretokenize_regex=PRETOKENIZE_REGEX,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in INTERNVL3_SPECIAL_TOKENS}
    return write_model_folder(
        path,
        architecture="InternVLForConditionalGeneration",
        model_type="internvl",
        tokenizer=tokenizer,
        preprocessor_config={**_PREPROCESSOR, "max_patches": max_patches},
        processor_config={"processor_class": "InternVLProcessor", "image_seq_length": 256},
        video_preprocessor_config=_VIDEO_PREPROCESSOR,
        chat_template=INTERNVL3_CHAT_TEMPLATE,
        extra_config={
            "image_token_id": ids["<IMG_CONTEXT>"],
            "downsample_ratio": 0.5,
            "projector_hidden_act": "gelu",
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "default",
            "vision_config": {
                "model_type": "internvl_vision",
                "image_size": [448, 448],
                "patch_size": [14, 14],
                "hidden_size": 1024,
            },
            "text_config": {
                "model_type": "qwen2",
                "vocab_size": len(tokenizer),
                "eos_token_id": ids["<|im_end|>"],
            },
        },
        tokenizer_config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None},
    )


def write_internvl3_demo(folder: Path) -> Path:
    """The ``internvl3`` demo model (hub layout)."""
    return write_internvl3_folder(folder)
