"""The gemma plugin's demo models: tiny Gemma 3, Gemma 3n and Gemma 4 folders, no weights, no hub.

Each folder has the family's real special tokens in a small Gemma-style tokenizer (a
SentencePiece-style BPE: spaces as ``"▁"``, byte fallback, one token per run of newlines, the
pipeline transformers' ``GemmaTokenizer`` rebuilds on load, a BOS token added to every encoding),
the real checkpoints' preprocessor and processor settings, and the real chat template's
rendering. They are what ``mmproc demo --model demo:gemma3`` (``gemma3-pan-and-scan``,
``gemma3n``, ``gemma4``) runs on, and what this plugin's tests build their folders with.

The Gemma 3 and Gemma 3n settings are those of ``google/gemma-3-4b-it`` and
``google/gemma-3n-E4B-it`` (nulls included: transformers' processors fill them in). Gemma 4's are
the defaults of transformers 5.24's Gemma 4 processor classes, written out as a folder (the hub's
files could not be read where this was written).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmproc.plugin import write_model_folder

__all__ = [
    "GEMMA3N_SPECIAL_TOKENS",
    "GEMMA3_CHAT_TEMPLATE",
    "GEMMA3_SPECIAL_TOKENS",
    "GEMMA4_CHAT_TEMPLATE",
    "GEMMA4_SPECIAL_TOKENS",
    "build_gemma_tokenizer",
    "write_gemma3_demo",
    "write_gemma3_folder",
    "write_gemma3_pan_and_scan_demo",
    "write_gemma3n_demo",
    "write_gemma3n_folder",
    "write_gemma4_demo",
    "write_gemma4_folder",
]

# Text the tokenizer learns its merges from: words after a space ("▁word"), and runs of newlines,
# which Gemma's vocabulary has one token for each (up to 31; 8 here).
_CORPUS_TEXT = """
Here is the original image and here are some crops to help you see better.
Describe this picture, please. What is in the image? Look at the photo and tell me.
What do you hear in this audio clip? Transcribe the speech. Watch the video and say what happens.
The cat sat on the red mat. A dog runs in the park. Two birds fly over the blue sea.
Compare the two images. Count the people. Read the sign. Which one is larger?
You are a helpful assistant. Answer the question. Thank you. Yes, no, maybe.
user model system hello world first second third then next last frame second minute
"""

GEMMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "[multimodal]",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
"""Gemma 3's special tokens (the first five are ids 0-4 in the real vocabulary too)."""

GEMMA3N_SPECIAL_TOKENS: tuple[str, ...] = (
    *GEMMA3_SPECIAL_TOKENS,
    "<start_of_audio>",
    "<end_of_audio>",
    "<audio_soft_token>",
)
"""Gemma 3n's: Gemma 3's and the audio ones."""

GEMMA4_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
)
"""Gemma 4's special tokens."""

_GEMMA3_NAMED = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
_GEMMA3N_NAMED = {
    **_GEMMA3_NAMED,
    "boa_token": "<start_of_audio>",
    "eoa_token": "<end_of_audio>",
    "audio_token": "<audio_soft_token>",
}
_GEMMA4_NAMED = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}

# The hub template of Gemma 3 (google/gemma-3-4b-it): a BOS, turns of <start_of_turn>role\n ...
# <end_of_turn>\n, a system message folded into the first user turn, one <start_of_image> per
# image part. Gemma 3n's is the same with <image_soft_token> / <audio_soft_token> parts.
_GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    '{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}'
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    '{%- set role = "model" -%}'
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "@PARTS@"
    "{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    '{{ raise_exception("Invalid content type") }}'
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}"
    "{%- endif -%}"
)
GEMMA3_CHAT_TEMPLATE = _GEMMA3_TEMPLATE.replace(
    "@PARTS@", "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
)
"""Gemma 3's chat template."""
GEMMA3N_CHAT_TEMPLATE = _GEMMA3_TEMPLATE.replace(
    "@PARTS@",
    "{%- if item['type'] == 'audio' -%}{{ '<audio_soft_token>' }}"
    "{%- elif item['type'] == 'image' -%}{{ '<image_soft_token>' }}",
)
"""Gemma 3n's chat template."""

# Gemma 4's: a BOS, turns of <|turn>role\n ... <turn|>\n (the assistant is "model"), each media
# part its placeholder between blank lines. The hub template renders the content through a
# macro; this one iterates over message['content'] itself, with the same rendering, because
# mmproc's chat path tells a template that walks content parts by such a loop (a macro's
# argument hides it: a proposal for the core's content-format detection).
_GEMMA4_CONTENT = (
    "{%- if @C@ is string -%}"
    "{{- @C@ | trim -}}"
    "{%- else -%}"
    "{%- for item in @C@ -%}"
    "{%- if item['type'] == 'text' -%}"
    "{{- item['text'] | trim -}}"
    "{%- elif item['type'] == 'image' -%}"
    "{{- '\n\n<|image|>\n\n' -}}"
    "{%- elif item['type'] == 'video' -%}"
    "{{- '\n\n<|video|>\n\n' -}}"
    "{%- elif item['type'] == 'audio' -%}"
    "{{- '\n\n<|audio|>\n\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
)
GEMMA4_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|turn>system\n' -}}"
    + _GEMMA4_CONTENT.replace("@C@", "messages[0]['content']")
    + "{{- '<turn|>\n' -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\n' -}}"
    + _GEMMA4_CONTENT.replace("@C@", "message['content']")
    + "{{- '<turn|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|turn>model\n' -}}"
    "{%- endif -%}"
)
"""Gemma 4's chat template."""

_RESCALE = 0.00392156862745098  # 1 / 255 as the hub files write it

GEMMA3_PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": _RESCALE,
    "size": {"height": 896, "width": 896},
}
"""``preprocessor_config.json`` of ``google/gemma-3-4b-it`` (pan-and-scan off: ``null``)."""

GEMMA3_PAN_AND_SCAN: dict[str, Any] = {
    "do_pan_and_scan": True,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
"""The pan-and-scan settings of a folder that switches it on (Gemma 3's recommended values)."""

GEMMA3N_PREPROCESSOR: dict[str, Any] = {
    "crop_size": None,
    "data_format": "channels_first",
    "default_to_square": False,
    "device": None,
    "dither": 0.0,
    "do_center_crop": None,
    "do_convert_rgb": None,
    "do_normalize": False,
    "do_rescale": True,
    "do_resize": True,
    "feature_extractor_type": "Gemma3nAudioFeatureExtractor",
    "feature_size": 128,
    "fft_length": 1024,
    "fft_overdrive": True,
    "frame_length": 512,
    "hop_length": 160,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "SiglipImageProcessorFast",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "input_data_format": None,
    "input_scale_factor": 1.0,
    "max_frequency": 7600.0,
    "mel_floor": 1e-05,
    "min_frequency": 125.0,
    "padding_side": "right",
    "padding_value": 0.0,
    "per_bin_mean": None,
    "per_bin_stddev": None,
    "preemphasis": 0.97,
    "preemphasis_htk_flavor": True,
    "processor_class": "Gemma3nProcessor",
    "resample": 2,
    "rescale_factor": _RESCALE,
    "return_attention_mask": True,
    "return_tensors": None,
    "sampling_rate": 16000,
    "size": {"height": 768, "width": 768},
}
"""``preprocessor_config.json`` of ``google/gemma-3n-E4B-it``: SigLIP images (768 x 768, no
normalisation, ``do_convert_rgb`` null) and the audio feature extractor, in one file."""

GEMMA4_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Gemma4ImageProcessor",
    "feature_extractor_type": "Gemma4AudioFeatureExtractor",
    "processor_class": "Gemma4Processor",
    "do_convert_rgb": True,
    "do_normalize": False,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
    "max_soft_tokens": 280,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "resample": 3,
    "rescale_factor": _RESCALE,
    "dither": 0.0,
    "feature_size": 128,
    "fft_overdrive": False,
    "frame_length_ms": 20.0,
    "hop_length_ms": 10.0,
    "input_scale_factor": 1.0,
    "max_frequency": 8000.0,
    "mel_floor": 0.001,
    "min_frequency": 0.0,
    "padding_side": "right",
    "padding_value": 0.0,
    "per_bin_mean": None,
    "per_bin_stddev": None,
    "preemphasis": 0.0,
    "preemphasis_htk_flavor": True,
    "return_attention_mask": True,
    "sampling_rate": 16000,
}
"""Gemma 4's image processor (280 soft tokens, patch 16, pooling 3, pixels in [0, 1]) and audio
feature extractor (128 mel bins of 20 ms frames every 10 ms at 16 kHz)."""

GEMMA4_VIDEO_PREPROCESSOR: dict[str, Any] = {
    "video_processor_type": "Gemma4VideoProcessor",
    "processor_class": "Gemma4Processor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_sample_frames": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
    "max_soft_tokens": 70,
    "num_frames": 32,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "resample": 3,
    "rescale_factor": _RESCALE,
}
"""Gemma 4's video processor: 32 frames, 70 soft tokens a frame."""


def build_gemma_tokenizer(
    special_tokens: Sequence[str],
    named_tokens: Mapping[str, str],
    *,
    vocab_size: int = 700,
) -> Any:
    """A small tokenizer that tokenizes as Gemma's does, holding ``special_tokens`` (each one id).

    A BPE over text whose spaces are ``"▁"``, with byte fallback (``<0x00>`` ... ``<0xFF>``), no
    pre-tokenizer at run time, and one token for every run of up to eight newlines, trained in
    milliseconds on a few sentences. It is transformers' ``GemmaTokenizer`` (whose pipeline
    transformers rebuilds from the vocabulary when the folder loads), adding ``<bos>`` to every
    encoding made with special tokens, as Gemma's do. ``named_tokens`` maps attribute names
    (``"boi_token"``, ``"image_token"``, ...) to tokens: the model-specific tokens its processor
    reads, saved in ``tokenizer_config.json``.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    base = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    lines = _CORPUS_TEXT.strip().splitlines()
    corpus = [*lines, *("\n" * n for n in range(1, 9)), "\n\n".join(lines), "\n".join(lines)]
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    # Training only: merges within a "▁word", a run of newlines or of spaces, as SentencePiece
    # learns them; at run time Gemma's pipeline has no split.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("▁?[^▁\n]+|\n+|▁+"), behavior="isolated")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*base, *(f"<0x{byte:02X}>" for byte in range(256))],
        # Digits are in the alphabet but in no merge: Gemma splits numbers into single digits.
        initial_alphabet=sorted(set(_CORPUS_TEXT.replace(" ", "▁")) | set("0123456789:")),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    merges: Any = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]
    ]
    tokenizer = GemmaTokenizer(
        vocab=model["vocab"],
        merges=merges,  # pairs: what tokenizers' BPE takes (transformers' annotation says str)
        add_bos_token=True,
        extra_special_tokens=dict(named_tokens),
    )
    others = [t for t in special_tokens if t not in base and t not in named_tokens.values()]
    tokenizer.add_special_tokens({"additional_special_tokens": others})
    return tokenizer


_ARCHITECTURES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma3n": "Gemma3nForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
}


def _write(
    path: str | Path,
    model_type: str,
    tokens: tuple[Sequence[str], Mapping[str, str]],
    config: Mapping[str, Any],
    **files: Any,
) -> Path:
    """A folder of ``model_type``: its tokenizer (special ``tokens`` and the named ones),
    ``config.json`` with ``config`` (a string value naming a token becomes its id) and the
    ``files`` :func:`write_model_folder` writes."""
    tokenizer = build_gemma_tokenizer(*tokens)
    ids = {
        key: int(tokenizer.convert_tokens_to_ids(value)) if isinstance(value, str) else value
        for key, value in config.items()
    }
    text = {"model_type": f"{model_type}_text", "vocab_size": len(tokenizer)}
    return write_model_folder(
        path,
        architecture=_ARCHITECTURES[model_type],
        model_type=model_type,
        tokenizer=tokenizer,
        extra_config={**ids, "text_config": text},
        **files,
    )


def write_gemma3_folder(path: str | Path, *, pan_and_scan: bool = False) -> Path:
    """Write a tiny Gemma 3 folder (``google/gemma-3-4b-it``'s settings and template).

    Settings: 896 x 896 bilinear, mean / std 0.5, 256 soft tokens an image; with
    ``pan_and_scan`` the preprocessor settings switch pan-and-scan crops on
    (:data:`GEMMA3_PAN_AND_SCAN`), otherwise they are ``null`` as in the released file.
    """
    config = {
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
        "image_token_index": "<image_soft_token>",
        "mm_tokens_per_image": 256,
        "vision_config": {"model_type": "siglip_vision_model", "image_size": 896, "patch_size": 14},
    }
    return _write(
        path,
        "gemma3",
        (GEMMA3_SPECIAL_TOKENS, _GEMMA3_NAMED),
        config,
        preprocessor_config={
            **GEMMA3_PREPROCESSOR,
            **(GEMMA3_PAN_AND_SCAN if pan_and_scan else {}),
        },
        processor_config={"image_seq_length": 256, "processor_class": "Gemma3Processor"},
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )


def write_gemma3n_folder(path: str | Path) -> Path:
    """Write a tiny Gemma 3n folder (``google/gemma-3n-E4B-it``'s settings and template):
    768 x 768 SigLIP images of 256 soft tokens, 16 kHz audio of 188."""
    config = {
        "audio_soft_tokens_per_image": 188,
        "vision_soft_tokens_per_image": 256,
        **{f"{name.removesuffix('_token')}_token_id": t for name, t in _GEMMA3N_NAMED.items()},
        "vision_config": {"model_type": "gemma3n_vision"},
        "audio_config": {"model_type": "gemma3n_audio"},
    }
    processor = {"audio_seq_length": 188, "image_seq_length": 256}
    return _write(
        path,
        "gemma3n",
        (GEMMA3N_SPECIAL_TOKENS, _GEMMA3N_NAMED),
        config,
        preprocessor_config=GEMMA3N_PREPROCESSOR,
        processor_config={**processor, "processor_class": "Gemma3nProcessor"},
        chat_template=GEMMA3N_CHAT_TEMPLATE,
    )


def write_gemma4_folder(path: str | Path) -> Path:
    """Write a tiny Gemma 4 folder: images of up to 280 soft tokens, videos of 32 frames of 70,
    16 kHz audio of one token per 40 ms (at most 750), its chat template."""
    named = {**_GEMMA4_NAMED, "video_token": "<|video|>"}
    config: dict[str, Any] = {
        f"{name.removesuffix('_token')}_token_id": token for name, token in named.items()
    }
    config["eoa_token_index"] = config.pop("eoa_token_id")  # Gemma 4's config names it so
    config["vision_config"] = {"model_type": "gemma4_vision"}
    config["audio_config"] = {"model_type": "gemma4_audio"}
    processor = {"audio_ms_per_token": 40, "audio_seq_length": 750, "image_seq_length": 280}
    return _write(
        path,
        "gemma4",
        (GEMMA4_SPECIAL_TOKENS, _GEMMA4_NAMED),
        config,
        preprocessor_config=GEMMA4_PREPROCESSOR,
        video_preprocessor_config=GEMMA4_VIDEO_PREPROCESSOR,
        processor_config={**processor, "processor_class": "Gemma4Processor"},
        chat_template=GEMMA4_CHAT_TEMPLATE,
    )


def write_gemma3_demo(folder: Path) -> Path:
    """The ``gemma3`` demo model."""
    return write_gemma3_folder(folder)


def write_gemma3_pan_and_scan_demo(folder: Path) -> Path:
    """The ``gemma3-pan-and-scan`` demo model: pan-and-scan switched on in the folder."""
    return write_gemma3_folder(folder, pan_and_scan=True)


def write_gemma3n_demo(folder: Path) -> Path:
    """The ``gemma3n`` demo model."""
    return write_gemma3n_folder(folder)


def write_gemma4_demo(folder: Path) -> Path:
    """The ``gemma4`` demo model."""
    return write_gemma4_folder(folder)
