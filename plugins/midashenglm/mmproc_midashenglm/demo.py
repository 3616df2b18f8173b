"""The midashenglm plugin's demo model: a tiny MiDashengLM folder, no weights, no hub.

What it carries of the real model (mispeech/midashenglm-7b): ``config.json``'s keys
(``model_type`` ``midashenglm``, ``subsample_factor`` 5, the Dasheng encoder's mel settings: hop
160, 64 mels at 16 kHz, ``audio_token_id``), the feature extractor's settings
(``Wav2Vec2FeatureExtractor`` at 16 kHz, ``do_normalize`` off, zero padding at the end), the
Qwen2 tokenizer's special tokens with the audio ones named as Qwen2.5-Omni's tokenizer names them
(``<|AUDIO|>``, ``<|audio_bos|>``, ``<|audio_eos|>``), and the ChatML chat format with the model's
system prompt and one ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per audio part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmproc.plugin import build_tokenizer, write_model_folder
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

__all__ = ["CHAT_TEMPLATE", "FEATURE_EXTRACTOR", "SPECIAL_TOKENS", "write_demo_folder"]

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
)

FEATURE_EXTRACTOR: dict[str, Any] = {
    "feature_extractor_type": "Wav2Vec2FeatureExtractor",
    "processor_class": "MiDashengLMProcessor",
    "feature_size": 1,
    "sampling_rate": 16000,
    "padding_value": 0.0,
    "padding_side": "right",
    "return_attention_mask": True,
    "do_normalize": False,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful language and speech assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_demo_folder(folder: Path) -> Path:
    """Write the demo model into ``folder`` and return it."""
    tokenizer = build_tokenizer(
        SPECIAL_TOKENS,
        named_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        pretokenize_regex=PRETOKENIZE_REGEX,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    return write_model_folder(
        folder,
        architecture="MiDashengLMModel",
        model_type="midashenglm",
        tokenizer=tokenizer,
        preprocessor_config=FEATURE_EXTRACTOR,
        chat_template=CHAT_TEMPLATE,
        extra_config={
            "subsample_factor": 5,
            "audio_token_id": ids["<|AUDIO|>"],
            "audio_encoder_config": {
                "model_type": "midashenglm_dasheng_encoder",
                "sample_rate": 16000,
                "n_fft": 512,
                "win_length": 512,
                "hop_length": 160,
                "n_mels": 64,
                "center": True,
                "patch_size": [64, 4],
                "patch_stride": [64, 4],
            },
            "text_config": {"model_type": "qwen2_5_omni_text", "vocab_size": len(tokenizer)},
        },
        tokenizer_config={
            "tokenizer_class": "Qwen2Tokenizer",
            "audio_token": "<|AUDIO|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
    )
