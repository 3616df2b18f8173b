"""Tiny local model folders for tests: a real tokenizer, real preprocessor settings, no weights.

No model hub is reachable where mmproc's tests run, so every test builds the folder it needs. A
folder holds what an engine reads from a hub checkout before it touches weights: ``config.json``
(architecture, model type, the placeholder token ids), ``preprocessor_config.json``, the tokenizer
files and the chat template. The tokenizer is small (a byte-level BPE trained on a few hundred
words) but holds the model's real special tokens, each a single id, so prompt expansion and
placeholder matching behave as they do with the real model.

The ready-made builders (`write_qwen2_vl_folder`, `write_paddleocr_vl_folder`) carry each model's
real preprocessor settings as published in its hub repository, including the hub's quirks.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

# AutoTokenizer rebuilds a Qwen2 tokenizer's pipeline from the vocabulary and merges with this
# regex (ignoring the pre-tokenizer stored in tokenizer.json), so ours uses the very same one.
from transformers.models.qwen2.tokenization_qwen2 import (
    PRETOKENIZE_REGEX as _QWEN2_PRETOKENIZE_REGEX,
)

__all__ = [
    "DEFAULT_WORDS",
    "PADDLEOCR_VL_CHAT_TEMPLATE",
    "PADDLEOCR_VL_SPECIAL_TOKENS",
    "QWEN2_5_VL_ADDED_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN2_VL_SPECIAL_TOKENS",
    "build_tokenizer",
    "write_model_folder",
    "write_paddleocr_vl_folder",
    "write_qwen2_vl_folder",
]

# A few hundred everyday words: enough for BPE to learn merges (so words, spaces and punctuation
# merge into multi-byte tokens the way real tokenizers do), small enough to train in milliseconds.
DEFAULT_WORDS: tuple[str, ...] = tuple(
    """
    the a an and or but if then of to in on at by for with from into over under about after before
    is are was were be been being has have had do does did can could will would should may might
    i you he she it we they me him her us them my your his its our their this that these those
    what which who whom whose where when why how all any both each few more most other some such
    no not only own same so than too very just also here there now again once out up down off
    picture image photo video frame describe look see show tell read write find count compare
    cat cats dog dogs bird fish horse cow sheep car bus train plane boat bike street road city
    house room table chair door window wall floor book page text word line letter number sign
    red green blue yellow black white gray brown orange purple pink color light dark bright
    big small large little long short tall wide high low left right top bottom middle center
    man woman child people person face hand head eye eyes hair shirt hat sky cloud sun tree
    water grass flower mountain river sea beach snow rain day night morning evening time year
    one two three four five six seven eight nine ten first second third last next many
    hello world please thank thanks yes answer question what's it's don't there's i'm you're
    """.split()
)

# --- Qwen2-VL / Qwen2.5-VL ----------------------------------------------------------------------

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

# --- PaddleOCR-VL -------------------------------------------------------------------------------

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


def _training_corpus(words: Sequence[str]) -> list[str]:
    """Sentences over ``words`` so BPE learns both in-word merges and space-prefixed tokens."""
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    # A second pass with a different stride puts each word after a space in another context.
    lines += [" ".join(words[i : i + 7]) + "." for i in range(3, len(words), 7)]
    lines += [f"{word}, {word}?" for word in words[:40]]
    return lines


def build_tokenizer(
    special_tokens: Sequence[str],
    *,
    words: Sequence[str] = DEFAULT_WORDS,
    vocab_size: int = 600,
    named_tokens: Mapping[str, str] | None = None,
    added_tokens: Sequence[str] = (),
    model_max_length: int = 32768,
) -> PreTrainedTokenizerFast:
    """Build a small real byte-level BPE tokenizer holding ``special_tokens``, each a single id.

    The BPE is trained (with `tokenizers`' `BpeTrainer`) on sentences made of ``words``; being
    byte-level it tokenises any text, and its merges cross the boundary between a word and the
    space before it, as Qwen's do. Normalisation (NFC) and pre-tokenisation (Qwen2's regex, then
    byte-level) are those transformers' ``Qwen2Tokenizer`` rebuilds on load, so a folder whose
    ``tokenizer_class`` is ``Qwen2Tokenizer`` tokenises exactly like the returned object.

    Args:
        special_tokens: Added as special tokens after the learned vocabulary, in this order, so
            their ids are consecutive and each matches only as a whole.
        words: The training vocabulary.
        vocab_size: Target size of the learned vocabulary (256 byte tokens plus merges).
        named_tokens: Attribute name -> token, e.g. ``{"eos_token": "<|im_end|>",
            "image_token": "<|image_pad|>"}``; each becomes ``tokenizer.<name>`` (and
            ``<name>_id``) and is saved in ``tokenizer_config.json``. Tokens named here that are
            not in ``special_tokens`` are added as special tokens too.
        added_tokens: Tokens added after the special ones as whole, non-special tokens.
        model_max_length: Saved as the tokenizer's maximum length.

    Returns:
        A transformers fast tokenizer (``PreTrainedTokenizerFast``).
    """
    named = dict(named_tokens or {})
    bad_names = [name for name in named if not name.endswith("_token")]
    if bad_names:
        raise ValueError(f"named token attributes must end in '_token': {bad_names}")
    specials = list(dict.fromkeys([*special_tokens, *named.values()]))
    overlap = set(specials) & set(added_tokens)
    if overlap:
        raise ValueError(f"tokens both special and non-special: {sorted(overlap)}")

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_corpus(words), trainer=trainer)
    # normalized=False: a special token must match its exact text, before NFC touches it.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if added_tokens:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])

    extra = [t for t in specials if t not in named.values()]
    # transformers treats any `<name>_token` keyword as a named (model-specific) special token,
    # which is how hub tokenizer configs declare `image_token` and friends.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        extra_special_tokens=extra,
        clean_up_tokenization_spaces=False,
        **named,
    )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_folder(
    path: str | Path,
    *,
    architecture: str,
    model_type: str,
    tokenizer: PreTrainedTokenizerFast,
    preprocessor_config: Mapping[str, Any],
    processor_config: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
    chat_template_file: Literal["json", "jinja"] = "json",
    extra_config: Mapping[str, Any] | None = None,
    video_preprocessor_config: Mapping[str, Any] | None = None,
    tokenizer_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a model folder in the hub's layout and return its path (created if missing).

    Files: ``config.json`` (``architectures``, ``model_type`` and ``extra_config``, which is where
    token ids such as ``image_token_id`` go), ``preprocessor_config.json``, ``tokenizer.json`` and
    ``tokenizer_config.json`` (from ``tokenizer.save_pretrained``, then updated with
    ``tokenizer_config``, e.g. ``{"tokenizer_class": "Qwen2Tokenizer"}``), the chat template as
    ``chat_template.json`` (``{"chat_template": ...}``, the older hub form) or
    ``chat_template.jinja``, and, when given, ``processor_config.json`` and
    ``video_preprocessor_config.json``.
    """
    if chat_template_file not in ("json", "jinja"):
        raise ValueError(
            f"chat_template_file must be 'json' or 'jinja', not {chat_template_file!r}"
        )
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)

    config = {"architectures": [architecture], "model_type": model_type, **(extra_config or {})}
    _write_json(folder / "config.json", config)
    _write_json(folder / "preprocessor_config.json", preprocessor_config)
    if processor_config is not None:
        _write_json(folder / "processor_config.json", processor_config)
    if video_preprocessor_config is not None:
        _write_json(folder / "video_preprocessor_config.json", video_preprocessor_config)

    tokenizer.save_pretrained(folder)
    if tokenizer_config:
        config_path = folder / "tokenizer_config.json"
        saved = json.loads(config_path.read_text(encoding="utf-8"))
        saved.update(tokenizer_config)
        _write_json(config_path, saved)

    if chat_template is not None:
        if chat_template_file == "json":
            _write_json(folder / "chat_template.json", {"chat_template": chat_template})
        else:
            (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return folder


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
            return _save_processor_folder(Path(hub), Path(path))

    tokenizer = build_tokenizer(
        QWEN2_VL_SPECIAL_TOKENS,
        named_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        added_tokens=QWEN2_5_VL_ADDED_TOKENS if variant == "qwen2_5_vl" else (),
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
            return _save_processor_folder(Path(hub), Path(path))

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


def _save_processor_folder(hub_folder: Path, path: Path) -> Path:
    """Load ``hub_folder``'s processor, ``save_pretrained`` it to ``path``, add ``config.json``."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(hub_folder, local_files_only=True)
    path.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(path)
    # save_pretrained writes the processor only; a model folder also has the model's config.
    (path / "config.json").write_bytes((hub_folder / "config.json").read_bytes())
    return path
