"""The glm4v plugin's demo models: tiny GLM-4.1V, GLM-4.5V and GLM-4.6V folders, no weights, no
hub.

Each is written with its release's real special tokens (a small byte-level BPE tokenizer from
:func:`mmproc.plugin.build_tokenizer`, with GLM-4's pre-tokenizer: digits in runs of up to
three, which the timestamps are made of), the hub folder's image and video settings (patch 14,
merge 2, frames in pairs, 2 fps, CLIP mean and std, bicubic) and a chat template in its form:

* ``glm-4.1v``: ``zai-org/GLM-4.1V-9B-Thinking``: ``Glm4vForConditionalGeneration``,
  ``Glm4vProcessor`` (timestamps in whole seconds), ``<|image|>`` right after the video tokens;
* ``glm-4.5v``: ``zai-org/GLM-4.5V``: the MoE architecture
  (``Glm4vMoeForConditionalGeneration``), ``Glm4vProcessor``, and twenty more special tokens
  before ``<|image|>``, whose id moves with them;
* ``glm-4.6v``: ``zai-org/GLM-4.6V``: the MoE architecture again, with ``Glm46VProcessor``
  (timestamps as ``x.y seconds``): the folder's ``processor_class`` decides.
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Literal

from mmproc.plugin import build_tokenizer, resave_with_processor, write_model_folder

__all__ = [
    "GLM_PRETOKENIZE_REGEX",
    "write_glm41v_demo",
    "write_glm45v_demo",
    "write_glm46v_demo",
    "write_glm_folder",
]

Release = Literal["4.1v", "4.5v", "4.6v"]

GLM_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""GLM-4's pre-tokenizer split (cl100k's): digits go in runs of up to three."""

# The special tokens every release has, in id order from <|endoftext|> (151329).
_COMMON_TOKENS = tuple(
    """
    <|endoftext|> [MASK] [gMASK] [sMASK] <sop> <eop> <|system|> <|user|> <|assistant|>
    <|observation|> <|begin_of_image|> <|end_of_image|> <|begin_of_video|> <|end_of_video|>
    """.split()
)
# GLM-4.5V and GLM-4.6V add these before <|image|> (151343 on GLM-4.1V, 151363 on them).
_GLM45_TOKENS = tuple(
    """
    <|begin_of_audio|> <|end_of_audio|> <|begin_of_transcription|> <|end_of_transcription|>
    <|code_prefix|> <|code_middle|> <|code_suffix|> <think> </think> <tool_call> </tool_call>
    <tool_response> </tool_response> <arg_key> </arg_key> <arg_value> </arg_value> /nothink
    <|begin_of_box|> <|end_of_box|>
    """.split()
)

_PATCHES = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True,
}

_USER_CONTENT = (
    "{% if m.content is string %}{{ m.content }}{% else %}{% for item in m.content %}"
    "{% if item.type == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif item.type == 'image' or 'image' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item.type == 'text' %}{{ item.text }}{% endif %}{% endfor %}{% endif %}"
)


def _template(thinking_switch: bool) -> str:
    """A GLM-4.xV chat template: ``[gMASK]<sop>``, role tokens, each media part's block; the
    later releases can switch thinking off."""
    generation = "<|assistant|>\n"
    if thinking_switch:
        generation += (
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n"
            "{% endif %}"
        )
    return (
        "[gMASK]<sop>{% for m in messages %}"
        "{% if m.role == 'system' %}<|system|>\n{{ m.content }}"
        "{% elif m.role == 'user' %}<|user|>\n" + _USER_CONTENT + "{% elif m.role == 'assistant' %}"
        "<|assistant|>\n{{ m.content if m.content is string else m.content[0].text }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}" + generation + "{% endif %}"
    )


# Per release: architecture, model type, processor class, the special tokens after the common
# ones, whether the chat template can switch thinking off.
_RELEASES: dict[str, dict[str, Any]] = {
    "4.1v": {
        "architecture": "Glm4vForConditionalGeneration",
        "model_type": "glm4v",
        "processor": "Glm4vProcessor",
        "tokens": ("<|image|>", "<|video|>", "<|begin_of_box|>", "<|end_of_box|>"),
        "thinking_switch": False,
    },
    "4.5v": {
        "architecture": "Glm4vMoeForConditionalGeneration",
        "model_type": "glm4v_moe",
        "processor": "Glm4vProcessor",
        "tokens": (*_GLM45_TOKENS, "<|image|>", "<|video|>"),
        "thinking_switch": True,
    },
    "4.6v": {
        "architecture": "Glm4vMoeForConditionalGeneration",
        "model_type": "glm4v_moe",
        "processor": "Glm46VProcessor",
        "tokens": (*_GLM45_TOKENS, "<|image|>", "<|video|>"),
        "thinking_switch": True,
    },
}


def write_glm_folder(
    path: str | Path,
    release: Release = "4.1v",
    *,
    layout: Literal["hub", "save_pretrained"] = "hub",
    architecture: str | None = None,
) -> Path:
    """Write a tiny GLM-4.xV folder with the release's real tokens and settings.

    Args:
        path: The folder to write.
        release: ``"4.1v"``, ``"4.5v"`` or ``"4.6v"``.
        layout: ``"hub"``: the files as the hub repository has them; ``"save_pretrained"``: what
            the processor's ``save_pretrained`` writes after loading the hub folder, plus
            ``config.json``.
        architecture: Another architecture for the folder (``Glm46VForConditionalGeneration``,
            with model type ``glm46v``), the rest as the release has it.
    """
    if release not in _RELEASES:
        raise ValueError(f"release must be one of {sorted(_RELEASES)}, not {release!r}")
    if layout == "save_pretrained":
        with tempfile.TemporaryDirectory(prefix="mmproc-glm4v-hub-") as hub:
            write_glm_folder(hub, release, architecture=architecture)
            return resave_with_processor(Path(hub), Path(path))
    if layout != "hub":
        raise ValueError(f"layout must be 'hub' or 'save_pretrained', not {layout!r}")
    spec = _RELEASES[release]
    model_type = "glm46v" if architecture == "Glm46VForConditionalGeneration" else None
    specials = (*_COMMON_TOKENS, *spec["tokens"])
    tokenizer = build_tokenizer(
        specials,
        named_tokens={
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "image_token": "<|image|>",
            "video_token": "<|video|>",
        },
        pretokenize_regex=GLM_PRETOKENIZE_REGEX,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in specials}
    model_type = model_type or spec["model_type"]
    sub = "glm4v_moe" if model_type == "glm4v_moe" else "glm4v"
    processor_class = spec["processor"]
    return write_model_folder(
        path,
        architecture=architecture or spec["architecture"],
        model_type=model_type,
        tokenizer=tokenizer,
        preprocessor_config={
            **_PATCHES,
            "image_processor_type": processor_class.replace("Processor", "ImageProcessor"),
            "processor_class": processor_class,
            "size": {"shortest_edge": 12544, "longest_edge": 9633792},
        },
        video_preprocessor_config={
            **_PATCHES,
            "video_processor_type": processor_class.replace("Processor", "VideoProcessor"),
            "processor_class": processor_class,
            "size": {"shortest_edge": 12544, "longest_edge": 47040000},
            "fps": 2,
            "max_duration": 300,
        },
        chat_template=_template(spec["thinking_switch"]),
        chat_template_file="jinja",
        extra_config={
            "image_token_id": ids["<|image|>"],
            "video_token_id": ids["<|video|>"],
            "image_start_token_id": ids["<|begin_of_image|>"],
            "image_end_token_id": ids["<|end_of_image|>"],
            "video_start_token_id": ids["<|begin_of_video|>"],
            "video_end_token_id": ids["<|end_of_video|>"],
            "vision_config": {
                "model_type": f"{sub}_vision",
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            "text_config": {"model_type": f"{sub}_text", "vocab_size": len(tokenizer)},
        },
    )


write_glm41v_demo = partial(write_glm_folder, release="4.1v")
"""The ``glm-4.1v`` demo model: ``write_glm41v_demo(folder)``."""
write_glm45v_demo = partial(write_glm_folder, release="4.5v")
"""The ``glm-4.5v`` demo model."""
write_glm46v_demo = partial(write_glm_folder, release="4.6v")
"""The ``glm-4.6v`` demo model."""
