"""The qwen_vl plugin's demo models: tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 folders, no
weights, no hub.

``write_qwen2_vl_folder`` writes a folder with Qwen2-VL's real special tokens (a small byte-level
BPE tokenizer made by :func:`mmproc.testing.build_tokenizer`), the real preprocessor settings as
the hub publishes them (quirks included) and the real chat template's rendering. It is what
``mmproc demo --model demo:qwen2-vl`` runs on, and what this plugin's tests and the core's
pipeline tests build their folders with. ``write_qwen3_vl_folder`` does the same for Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (``demo:qwen3-vl``, ``demo:qwen3-vl-moe``, ``demo:qwen3.5``,
``demo:qwen3.5-moe``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from mmproc.plugin import build_tokenizer, resave_with_processor, write_model_folder

# AutoTokenizer rebuilds a Qwen2 tokenizer's pipeline from the vocabulary and merges with this
# regex (ignoring the pre-tokenizer stored in tokenizer.json), so the demo's uses the very same.
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.models.qwen3_5.tokenization_qwen3_5 import (
    PRETOKENIZE_REGEX as QWEN3_5_PRETOKENIZE_REGEX,
)

__all__ = [
    "QWEN2_5_VL_ADDED_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN2_VL_SPECIAL_TOKENS",
    "QWEN3_5_CHAT_TEMPLATE",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_VARIANTS",
    "QWEN3_VL_CHAT_TEMPLATE",
    "write_qwen2_5_vl_demo",
    "write_qwen2_vl_demo",
    "write_qwen2_vl_folder",
    "write_qwen3_5_demo",
    "write_qwen3_5_moe_demo",
    "write_qwen3_vl_demo",
    "write_qwen3_vl_folder",
    "write_qwen3_vl_moe_demo",
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

# The tokenizer_config.json entries of the hub's Qwen-VL folders beside the tokens.
_QWEN_TOKENIZER_CONFIG: dict[str, Any] = {
    "tokenizer_class": "Qwen2Tokenizer",
    "errors": "replace",
    "split_special_tokens": False,
    "bos_token": None,
    "unk_token": None,
    "add_prefix_space": False,
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
        tokenizer_config=_QWEN_TOKENIZER_CONFIG,
    )


def write_qwen2_vl_demo(folder: Path) -> Path:
    """The ``qwen2-vl`` demo model (hub layout)."""
    return write_qwen2_vl_folder(folder)


def write_qwen2_5_vl_demo(folder: Path) -> Path:
    """The ``qwen2.5-vl`` demo model (hub layout)."""
    return write_qwen2_vl_folder(folder, variant="qwen2_5_vl")


# --- Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE -------------------------------------------------

# Qwen3's vocabulary keeps Qwen2.5-VL's special and added tokens (ids 151643 ... 151664 for
# Qwen3-VL, 248044 ... 248065 for Qwen3.5) and adds these, also non-special: 151665 ... 151668.
QWEN3_ADDED_TOKENS: tuple[str, ...] = (
    *QWEN2_5_VL_ADDED_TOKENS,
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# The prompt text of one user or tool message's content parts, in Qwen3-VL's template: its image
# and video parts as vision markers (numbered with add_vision_id), its text parts as they are. The
# loop runs over `message.content` itself, as the hub template's does.
_QWEN3_VL_PARTS = """\
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for part in message.content %}
                {%- if part.type == 'image' or 'image' in part or 'image_url' in part %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
                {%- elif part.type == 'video' or 'video' in part %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}
                    {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
                {%- elif 'text' in part %}
                    {{- part.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
"""

# Renders the same prompt text as the Qwen3-VL-*-Instruct hub template, written as it is:
# structure in tags, every character of the prompt in an expression (so transformers'
# trim_blocks / lstrip_blocks change nothing). No default system turn (a system message only as
# the first one), JSON tool signatures in the system turn and JSON calls in assistant turns, tool
# results as user turns of <tool_response> blocks, one `<|vision_start|><|..._pad|><|vision_end|>`
# per image or video part.
QWEN3_VL_CHAT_TEMPLATE = (
    """\
{%- macro system_text(content) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for part in content if 'text' in part %}{{- part.text }}{%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- system_text(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
        ~ 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        ~ 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        ~ '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
        ~ '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + system_text(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' }}
"""
    + _QWEN3_VL_PARTS
    + """\
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + system_text(message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}
            {%- set call = call.function if call.function else call %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
"""
    + _QWEN3_VL_PARTS
    + """\
        {{- '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

# Renders the same prompt text as the Qwen3.5 hub template (shipped as chat_template.jinja), and is
# laid out as it is: every message's content goes through one macro, render_content, which walks
# the content parts (vision markers numbered with add_vision_id, text; an image in a system
# message is an error). A thinking template: tools and calls in Qwen3.5's XML function form; an
# assistant turn after the last user query shows its reasoning (`reasoning_content`, or what its
# content holds before `</think>`) in a <think> block, earlier ones drop it; the generation prompt
# opens a <think> block (one closed at once with enable_thinking=false).
QWEN3_5_CHAT_TEMPLATE = """\
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- set image_count.value = image_count.value + 1 %}
                {%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- set video_count.value = video_count.value + 1 %}
                {%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is not none and content is defined %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content, true) | trim + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with '
        ~ 'NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n'
        ~ '<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>'
        ~ '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content, true) | trim
        + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.last_query = messages | length - 1 - loop.index0 %}
        {%- set ns.found = true %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = render_content(message.content) | trim %}
    {%- if message.role == 'system' and not loop.first %}
        {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'
                + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function else call %}
            {%- if not loop.first %}
                {{- '\\n' }}
            {%- elif content | trim %}
                {{- '\\n\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
            {%- for name, value in (call.arguments or {}) | items %}
                {%- if value is mapping or (value is sequence and value is not string) %}
                    {%- set value = value | tojson %}
                {%- endif %}
                {{- '<parameter=' + name + '>\\n' + value | string + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""

# The patches of the hub's Qwen3-VL and Qwen3.5 image and video processors: 16-pixel patches, two
# frames each, 2 x 2 merged, mean and std 0.5. The resampling filter is in neither file: the
# classes' default, bicubic.
_QWEN3_PATCHES: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
}

# Their preprocessor_config.json: 65536 to 16777216 pixels per image (256 x 256 to 4096 x 4096).
_QWEN3_IMAGE_PREPROCESSOR: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    **_QWEN3_PATCHES,
    "image_processor_type": "Qwen2VLImageProcessorFast",
}

# Their video_preprocessor_config.json: the budget counts the pixels of all frames together
# (4096 to 25165824); the sampling (2 fps, 4 to 768 frames) is the class default.
_QWEN3_VIDEO_PREPROCESSOR: dict[str, Any] = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    **_QWEN3_PATCHES,
    "video_processor_type": "Qwen3VLVideoProcessor",
}

QWEN3_VARIANTS: dict[str, dict[str, str]] = {
    "qwen3_vl": {"architecture": "Qwen3VLForConditionalGeneration", "template": "qwen3_vl"},
    "qwen3_vl_moe": {"architecture": "Qwen3VLMoeForConditionalGeneration", "template": "qwen3_vl"},
    "qwen3_5": {"architecture": "Qwen3_5ForConditionalGeneration", "template": "qwen3_5"},
    "qwen3_5_moe": {"architecture": "Qwen3_5MoeForConditionalGeneration", "template": "qwen3_5"},
}
"""Model type -> the architecture its folders name and the chat template family."""

Qwen3Variant = Literal["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def write_qwen3_vl_folder(
    path: str | Path,
    *,
    variant: Qwen3Variant = "qwen3_vl",
    layout: Literal["hub", "save_pretrained"] = "hub",
) -> Path:
    """Write a tiny Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 or Qwen3.5-MoE folder with the real tokens and
    processor settings.

    Images: patch 16, merge 2, temporal patch 2, 65536 to 16777216 pixels, mean / std 0.5,
    bicubic. Videos: the same patches, 4096 to 25165824 pixels over all frames, sampled at 2 fps,
    4 to 768 frames. The tokenizer holds Qwen3's special tokens in their real order and
    ``<tool_call>`` ... ``</think>`` as added, non-special tokens; Qwen3.5's folder names
    ``Qwen2Tokenizer`` as the hub's does, and transformers loads it as ``Qwen3_5Tokenizer``
    (its pre-tokenizer split, which this tokenizer is built with).

    Args:
        path: The folder to write.
        variant: The model type: ``"qwen3_vl"``, ``"qwen3_vl_moe"`` (Qwen3-VL's instruct
            template, ``chat_template.json``), ``"qwen3_5"`` or ``"qwen3_5_moe"`` (the thinking
            template, ``chat_template.jinja``).
        layout: ``"hub"``: the files as the hub repositories have them
            (``preprocessor_config.json``, ``video_preprocessor_config.json``).
            ``"save_pretrained"``: what ``Qwen3VLProcessor.save_pretrained`` writes after loading
            the hub folder (``processor_config.json`` holding both processors), plus
            ``config.json``.
    """
    if variant not in QWEN3_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(QWEN3_VARIANTS)}, not {variant!r}")
    if layout not in ("hub", "save_pretrained"):
        raise ValueError(f"layout must be 'hub' or 'save_pretrained', not {layout!r}")
    if layout == "save_pretrained":
        with tempfile.TemporaryDirectory(prefix="mmproc-qwen3-hub-") as hub:
            write_qwen3_vl_folder(hub, variant=variant, layout="hub")
            return resave_with_processor(Path(hub), Path(path))

    names = QWEN3_VARIANTS[variant]
    qwen3_5 = names["template"] == "qwen3_5"
    tokenizer = build_tokenizer(
        QWEN2_VL_SPECIAL_TOKENS,
        named_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        added_tokens=QWEN3_ADDED_TOKENS,
        pretokenize_regex=QWEN3_5_PRETOKENIZE_REGEX if qwen3_5 else PRETOKENIZE_REGEX,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2_VL_SPECIAL_TOKENS}
    extra_config = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "text_config": {
            "model_type": f"{variant}_text",
            "vocab_size": len(tokenizer),
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        "vision_config": {
            "model_type": f"{variant}_vision",
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }
    return write_model_folder(
        path,
        architecture=names["architecture"],
        model_type=variant,
        tokenizer=tokenizer,
        preprocessor_config=_QWEN3_IMAGE_PREPROCESSOR,
        video_preprocessor_config=_QWEN3_VIDEO_PREPROCESSOR,
        chat_template=QWEN3_5_CHAT_TEMPLATE if qwen3_5 else QWEN3_VL_CHAT_TEMPLATE,
        chat_template_file="jinja" if qwen3_5 else "json",
        extra_config=extra_config,
        # Qwen3.5's hub folders name Qwen2Tokenizer too (transformers loads Qwen3_5Tokenizer).
        tokenizer_config={**_QWEN_TOKENIZER_CONFIG, "model_max_length": 262144},
    )


def write_qwen3_vl_demo(folder: Path) -> Path:
    """The ``qwen3-vl`` demo model (hub layout)."""
    return write_qwen3_vl_folder(folder)


def write_qwen3_vl_moe_demo(folder: Path) -> Path:
    """The ``qwen3-vl-moe`` demo model (hub layout)."""
    return write_qwen3_vl_folder(folder, variant="qwen3_vl_moe")


def write_qwen3_5_demo(folder: Path) -> Path:
    """The ``qwen3.5`` demo model (hub layout)."""
    return write_qwen3_vl_folder(folder, variant="qwen3_5")


def write_qwen3_5_moe_demo(folder: Path) -> Path:
    """The ``qwen3.5-moe`` demo model (hub layout)."""
    return write_qwen3_vl_folder(folder, variant="qwen3_5_moe")
