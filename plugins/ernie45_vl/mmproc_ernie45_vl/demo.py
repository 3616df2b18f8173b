"""The ernie45_vl plugin's demo models: tiny ERNIE-4.5-VL folders of both layouts, no weights,
no hub.

What they carry of the real model (baidu/ERNIE-4.5-VL-28B-A3B-PT and transformers' conversion of
it), as far as the published sources state it:

* the special tokens, in their order in the real vocabulary (``<unk>`` ``<s>`` ``</s>``, the
  sentence markers, ``<|IMAGE_PLACEHOLDER|>``, the location / crop / image / video / ASR markers;
  the converted tokenizer adds ``<|VIDEO_PLACEHOLDER|>``, ``<think>`` and ``</think>``) with
  their roles (``cls`` ``<|begin_of_sentence|>``, ``sep`` ``<|end_of_sentence|>``, ``mask``
  ``<mask:1>``, ``pad`` ``<unk>``, no BOS added by the tokenizer). The ids are those of a small
  byte-level BPE (:func:`mmproc.testing.build_tokenizer`), not the real 103 424; ``config.json``
  states them. The original layout's ``<|image@placeholder|>`` / ``<|video@placeholder|>`` are
  single tokens here (the chat template writes them; whether Baidu's vocabulary holds them whole
  is not published, and the plugin matches them as the folder's tokenizer splits them);
* ``config.json``'s keys of each layout (flat ``ernie4_5_moe_vl`` with ``im_patch_id``,
  ``spatial_conv_size``, ``temporal_conv_size``, ``vision_config``; nested ``ernie4_5_vl_moe``);
  the original's ``auto_map`` entries name Baidu's remote-code modules, which the folder does not
  contain and the plugin never follows;
* the preprocessing settings: patch 14, merge 2, bicubic, OpenAI CLIP mean and std, images within
  4·28·28 to 6177·28·28 pixels, video frames within 299·28·28 to 1196·28·28, 2 fps, 16 to 180
  frames, timestamps drawn in ``Roboto-Regular.ttf``;
* the chat format (``<|begin_of_sentence|>``, ``User: ...\\n``, ``Picture N:`` / ``Video N:``
  before each marker, ``Assistant: ``).

The font file is Pillow's bundled TrueType font saved under the name the processors load
(``Roboto-Regular.ttf``): there is no hub to fetch Roboto from, and any TrueType font exercises
the same code. A real folder's own files are always what the plugin reads.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from mmproc.plugin import build_tokenizer, resave_with_processor, write_model_folder

from mmproc_ernie45_vl.original import CLIP_MEAN, CLIP_STD, FONT_FILE

__all__ = [
    "CONVERTED_ADDED_TOKENS",
    "CONVERTED_CHAT_TEMPLATE",
    "CONVERTED_IMAGE_PROCESSOR",
    "CONVERTED_VIDEO_PROCESSOR",
    "NAMED_TOKENS",
    "ORIGINAL_CHAT_TEMPLATE",
    "ORIGINAL_MARKER_TOKENS",
    "ORIGINAL_PREPROCESSOR",
    "ORIGINAL_PROCESSOR",
    "SPECIAL_TOKENS",
    "write_converted_demo",
    "write_converted_folder",
    "write_font",
    "write_original_demo",
    "write_original_folder",
]

ARCHITECTURE = "Ernie4_5_VLMoeForConditionalGeneration"

# In the order of their ids in the real vocabulary (<unk> 0, <s> 1, </s> 2, ...,
# <|IMAGE_PLACEHOLDER|> 100295, ..., <|IMAGE_START|> 101304 ... <|VIDEO_END|> 101307, ...). The
# 1001 location tokens <|LOC_0|> ... <|LOC_1000|> and the unused fillers are left out.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "<mask:0>",
    "<mask:1>",
    "<mask:4>",
    "<mask:5>",
    "<mask:6>",
    "<mask:7>",
    "<|begin_of_sentence|>",
    "<|end_of_sentence|>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|AUDIO_PLACEHOLDER|>",
    "<|LOC_BEGIN|>",
    "<|LOC_END|>",
    "<|LOC_SEP|>",
    "<|CROP_COL_SEP|>",
    "<|CROP_ROW_SEP|>",
    "<|IMAGE_SEP|>",
    "<|IMAGE_START|>",
    "<|IMAGE_END|>",
    "<|VIDEO_START|>",
    "<|VIDEO_END|>",
    "<|ASR_START|>",
    "<|ASR_END|>",
)

#: Added by transformers' converter (``<|VIDEO_PLACEHOLDER|>`` takes the first free id, 103367).
CONVERTED_ADDED_TOKENS: tuple[str, ...] = ("<|VIDEO_PLACEHOLDER|>", "<think>", "</think>")

#: What the original chat template writes inside each image / video marker.
ORIGINAL_MARKER_TOKENS: tuple[str, ...] = ("<|image@placeholder|>", "<|video@placeholder|>")

#: The tokenizer's token roles (both layouts; transformers' converter passes the same).
NAMED_TOKENS: dict[str, str] = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<unk>",
    "cls_token": "<|begin_of_sentence|>",
    "sep_token": "<|end_of_sentence|>",
    "mask_token": "<mask:1>",
}

# The converted tokenizer names its vision tokens (Ernie4_5_VLMoeProcessor reads them).
_CONVERTED_VISION_TOKENS = {
    "image_token": "<|IMAGE_PLACEHOLDER|>",
    "image_start_token": "<|IMAGE_START|>",
    "image_end_token": "<|IMAGE_END|>",
    "video_token": "<|VIDEO_PLACEHOLDER|>",
    "video_start_token": "<|VIDEO_START|>",
    "video_end_token": "<|VIDEO_END|>",
}


def _chat_template(image: str, video: str, *, thinking: bool) -> str:
    """ERNIE-4.5-VL's chat format: ``<|begin_of_sentence|>``, system text and ``User: ...``
    lines ending in a newline, ``Picture N:`` / ``Video N:`` before each marker (numbered apart),
    ``Assistant: ...<|end_of_sentence|>``; the generation prompt ``Assistant: `` (with the
    converted template's empty think block unless ``enable_thinking``)."""
    generation = "Assistant: "
    if thinking:
        generation += (
            "{% if enable_thinking is defined and enable_thinking %}<think>"
            "{% else %}<think>\n\n</think>\n\n{% endif %}"
        )
    return (
        "{% set image_count = namespace(value=0) %}"
        "{% set video_count = namespace(value=0) %}"
        "<|begin_of_sentence|>"
        "{% for message in messages %}"
        "{% if message['role'] in ['system', 'user'] %}"
        "{% if message['role'] == 'user' %}User: {% endif %}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ['image', 'image_url'] %}"
        "{% set image_count.value = image_count.value + 1 %}"
        f"Picture {{{{ image_count.value }}}}:{image}"
        "{% elif part['type'] in ['video', 'video_url'] %}"
        "{% set video_count.value = video_count.value + 1 %}"
        f"Video {{{{ video_count.value }}}}:{video}"
        "{% endif %}"
        "{% endfor %}{% endif %}{{ '\\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "Assistant: {{ message['content'] }}<|end_of_sentence|>"
        "{% endif %}"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{generation}{{% endif %}}"
    )


CONVERTED_CHAT_TEMPLATE = _chat_template(
    "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
    "<|VIDEO_START|><|VIDEO_PLACEHOLDER|><|VIDEO_END|>",
    thinking=True,
)
ORIGINAL_CHAT_TEMPLATE = _chat_template(
    "<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>",
    "<|VIDEO_START|><|video@placeholder|><|VIDEO_END|>",
    thinking=False,
)

_RESCALE = 1 / 255

#: transformers' converted image processor settings (``preprocessor_config.json``).
CONVERTED_IMAGE_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Ernie4_5_VLMoeImageProcessor",
    "processor_class": "Ernie4_5_VLMoeProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": 3,
    "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 6177 * 28 * 28},
    "do_rescale": True,
    "rescale_factor": _RESCALE,
    "do_normalize": True,
    "image_mean": list(CLIP_MEAN),
    "image_std": list(CLIP_STD),
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 2,
}

#: transformers' converted video processor settings (``video_preprocessor_config.json``).
CONVERTED_VIDEO_PROCESSOR: dict[str, Any] = {
    "video_processor_type": "Ernie4_5_VLMoeVideoProcessor",
    "processor_class": "Ernie4_5_VLMoeProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": 3,
    "size": {"shortest_edge": 299 * 28 * 28, "longest_edge": 1196 * 28 * 28},
    "do_rescale": True,
    "rescale_factor": _RESCALE,
    "do_normalize": True,
    "image_mean": list(CLIP_MEAN),
    "image_std": list(CLIP_STD),
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_frames": 16,
    "max_frames": 180,
    "do_sample_frames": True,
    "draw_on_frames": True,
    "font": FONT_FILE,
}

#: The original image processor's settings (``preprocessor_config.json``); the processor calls it
#: with rescale and normalise off and resizes to its own limits (``ORIGINAL_PROCESSOR``).
ORIGINAL_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Ernie4_5_VLImageProcessor",
    "processor_class": "Ernie4_5_VLProcessor",
    "auto_map": {
        "AutoImageProcessor": "image_processing_ernie4_5_vl.Ernie4_5_VLImageProcessor",
        "AutoProcessor": "processing_ernie4_5_vl.Ernie4_5_VLProcessor",
    },
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": _RESCALE,
    "do_normalize": True,
    "image_mean": list(CLIP_MEAN),
    "image_std": list(CLIP_STD),
    "min_pixels": 4 * 28 * 28,
    "max_pixels": 6177 * 28 * 28,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_conv_size": 2,
}

#: The original processor's own settings (its keyword arguments and defaults).
ORIGINAL_PROCESSOR: dict[str, Any] = {
    "processor_class": "Ernie4_5_VLProcessor",
    "spatial_conv_size": 2,
    "temporal_conv_size": 2,
    "image_min_pixels": 4 * 28 * 28,
    "image_max_pixels": 6177 * 28 * 28,
    "video_min_pixels": 299 * 28 * 28,
    "video_max_pixels": 1196 * 28 * 28,
    "video_target_frames": -1,
    "video_frames_sample": "leading",
    "video_max_frames": 180,
    "video_min_frames": 16,
    "video_fps": 2,
}

_VISION = {"patch_size": 14, "spatial_merge_size": 2, "in_channels": 3, "hidden_size": 1280}
_TEXT = {
    "hidden_size": 2560,
    "num_hidden_layers": 28,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
}


def write_font(path: str | Path) -> Path:
    """Write a TrueType font to ``path`` (Pillow's bundled one) and return the path."""
    from PIL import ImageFont

    font = ImageFont.load_default(size=20)
    if not isinstance(font, ImageFont.FreeTypeFont):
        raise RuntimeError("writing a TrueType font needs Pillow built with FreeType")
    target = Path(path)
    target.write_bytes(font.font_bytes)
    return target


def _tokenizer(extra: tuple[str, ...], named: dict[str, str], add_bos: bool) -> Any:
    return build_tokenizer(
        (*SPECIAL_TOKENS, *extra),
        named_tokens={**NAMED_TOKENS, **named},
        model_max_length=131072,
        add_bos_token=add_bos,
    )


def write_converted_folder(
    path: str | Path,
    *,
    layout: Literal["hub", "save_pretrained"] = "hub",
    font: bool = True,
    add_bos_token: bool = False,
) -> Path:
    """Write a tiny converted-layout folder (``model_type`` ``ernie4_5_vl_moe``).

    Args:
        path: The folder to write.
        layout: ``"hub"``: ``preprocessor_config.json`` and ``video_preprocessor_config.json``
            (what the converter's transformers wrote); ``"save_pretrained"``: what transformers 5
            writes after loading that folder (one nested ``processor_config.json``,
            ``chat_template.jinja``, the font copied along).
        font: Write ``Roboto-Regular.ttf`` (leave it out to test the missing-font error).
        add_bos_token: A tokenizer that starts every encoding with ``<s>``.
    """
    if layout == "save_pretrained":
        with tempfile.TemporaryDirectory(prefix="mmproc-ernie-hub-") as hub:
            write_converted_folder(hub, font=True, add_bos_token=add_bos_token)
            target = resave_with_processor(Path(hub), Path(path))
        if not font:
            (target / FONT_FILE).unlink()
        return target
    if layout != "hub":
        raise ValueError(f"layout must be 'hub' or 'save_pretrained', not {layout!r}")
    tokenizer = _tokenizer(CONVERTED_ADDED_TOKENS, _CONVERTED_VISION_TOKENS, add_bos_token)
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in _CONVERTED_VISION_TOKENS.items()}
    folder = write_model_folder(
        path,
        architecture=ARCHITECTURE,
        model_type="ernie4_5_vl_moe",
        tokenizer=tokenizer,
        preprocessor_config=CONVERTED_IMAGE_PROCESSOR,
        video_preprocessor_config=CONVERTED_VIDEO_PROCESSOR,
        chat_template=CONVERTED_CHAT_TEMPLATE,
        chat_template_file="jinja",
        extra_config={
            **{f"{name}_id": index for name, index in ids.items()},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<s>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("</s>"),
            "pad_token_id": tokenizer.convert_tokens_to_ids("<unk>"),
            "text_config": {
                "model_type": "ernie4_5_vl_moe_text",
                "vocab_size": len(tokenizer),
                **_TEXT,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 500000.0,
                    "mrope_section": [22, 22, 20],
                },
            },
            "vision_config": {
                "model_type": "ernie4_5_vl_moe_vision",
                **_VISION,
                "depth": 32,
                "num_heads": 16,
                "intermediate_size": 5120,
                "temporal_merge_size": 2,
                "hidden_act": "quick_gelu",
                "rms_norm_eps": 1e-6,
            },
        },
    )
    if font:
        write_font(folder / FONT_FILE)
    return folder


def write_original_folder(
    path: str | Path,
    *,
    font: bool = True,
    remote_code: bool = True,
    add_bos_token: bool = False,
) -> Path:
    """Write a tiny original-layout folder (``model_type`` ``ernie4_5_moe_vl``).

    Args:
        path: The folder to write.
        font: Write ``Roboto-Regular.ttf`` (leave it out to test the missing-font error).
        remote_code: Name Baidu's remote tokenizer class and ``auto_map`` in
            ``tokenizer_config.json`` and ``config.json``, as the hub folder does (the Python
            files are not written). Without: the generic ``TokenizersBackend``, which
            transformers' ``AutoTokenizer`` loads without asking to run code.
        add_bos_token: A tokenizer that starts every encoding with ``<s>``.
    """
    tokenizer = _tokenizer(ORIGINAL_MARKER_TOKENS, {}, add_bos_token)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    extra_config: dict[str, Any] = {
        "im_patch_id": ids["<|IMAGE_PLACEHOLDER|>"],
        "image_start_token_id": ids["<|IMAGE_START|>"],
        "image_end_token_id": ids["<|IMAGE_END|>"],
        "video_start_token_id": ids["<|VIDEO_START|>"],
        "video_end_token_id": ids["<|VIDEO_END|>"],
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<unk>"],
        "vocab_size": len(tokenizer),
        **_TEXT,
        "rope_theta": 500000,
        "rope_3d": True,
        "freq_allocation": 20,
        "spatial_conv_size": 2,
        "temporal_conv_size": 2,
        "use_temporal_conv": True,
        "pixel_hidden_size": 1280,
        "vision_config": {
            **_VISION,
            "depth": 32,
            "embed_dim": 1280,
            "num_heads": 16,
            "mlp_ratio": 4,
            "hidden_act": "quick_gelu",
        },
    }
    tokenizer_config: dict[str, Any] = {"header_start_token": "<mask:6>", "padding_side": "right"}
    if remote_code:
        extra_config["auto_map"] = {
            "AutoConfig": "configuration_ernie4_5_vl.Ernie4_5_VLMoEConfig",
            "AutoModelForCausalLM": "modeling_ernie4_5_vl.Ernie4_5_VLMoeForConditionalGeneration",
        }
        tokenizer_config["tokenizer_class"] = "Ernie4_5_VLTokenizer"
        tokenizer_config["auto_map"] = {
            "AutoTokenizer": ["tokenization_ernie4_5_vl.Ernie4_5_VLTokenizer", None]
        }
    folder = write_model_folder(
        path,
        architecture=ARCHITECTURE,
        model_type="ernie4_5_moe_vl",
        tokenizer=tokenizer,
        preprocessor_config=ORIGINAL_PREPROCESSOR if remote_code else _without_auto_map(),
        processor_config=ORIGINAL_PROCESSOR,
        chat_template=ORIGINAL_CHAT_TEMPLATE,
        chat_template_file="jinja",
        extra_config=extra_config,
        tokenizer_config=tokenizer_config,
    )
    if font:
        write_font(folder / FONT_FILE)
    return folder


def _without_auto_map() -> dict[str, Any]:
    return {k: v for k, v in ORIGINAL_PREPROCESSOR.items() if k != "auto_map"}


def write_converted_demo(folder: Path) -> Path:
    """The ``ernie45-vl`` demo model (converted layout, hub files)."""
    return write_converted_folder(folder)


def write_original_demo(folder: Path) -> Path:
    """The ``ernie45-vl-original`` demo model (original layout)."""
    return write_original_folder(folder)
