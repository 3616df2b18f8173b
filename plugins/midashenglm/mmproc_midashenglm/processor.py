"""MiDashengLM's processor, rebuilt from the model's rules (its own is remote code, never run).

A prompt holds one ``<|AUDIO|>`` per clip, normally between ``<|audio_bos|>`` and
``<|audio_eos|>`` (the chat template writes ``<|audio_bos|><|AUDIO|><|audio_eos|>``); a bare
``<|AUDIO|>`` with neither neighbour gets both, as the model's processor adds them. Clips are
mono waveforms at the feature extractor's rate (transformers' ``Wav2Vec2FeatureExtractor``,
``do_normalize`` off), batched by the extractor's padding; ``input_values`` are the padded
waveforms, ``audio_length`` each clip's unpadded sample count.

Each ``<|AUDIO|>`` expands to one token per 0.2 s: ``(1 + L // hop) // 4 // subsample_factor``
for ``L`` samples (the mel hop, 160; the encoder's time stride, 4; ``subsample_factor`` of
``config.json``, 5). Two serving rules differ from the model's own processor, which gives short
clips no token at all and so breaks the request: a clip shorter than ``MIN_SAMPLES`` (3200, 0.2 s)
is padded with zeros to that length, and every clip gets at least one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "ENCODER_TIME_STRIDE",
    "MIN_SAMPLES",
    "MiDashengLMProcessor",
]

#: The shortest clip the model is served, in samples (0.2 s at 16 kHz): shorter ones are padded.
MIN_SAMPLES = 3200
#: Mel frames per encoder step (the Dasheng encoder's patch stride in time).
ENCODER_TIME_STRIDE = 4


class MiDashengLMProcessor:
    """Tokenizer and feature extractor of MiDashengLM, with the model's prompt rules.

    Deep-copyable (the worker pool gives each thread its own copy); it keeps no state between
    calls.
    """

    def __init__(
        self,
        *,
        feature_extractor: Any,
        tokenizer: Any,
        audio_token: str,
        audio_bos_token: str,
        audio_eos_token: str,
        hop_length: int = 160,
        subsample_factor: int = 5,
        chat_template: str | None = None,
    ) -> None:
        self.feature_extractor = feature_extractor
        self.tokenizer = tokenizer
        self.audio_token = audio_token
        self.audio_bos_token = audio_bos_token
        self.audio_eos_token = audio_eos_token
        self.audio_token_id = tokenizer.convert_tokens_to_ids(audio_token)
        self.audio_bos_token_id = tokenizer.convert_tokens_to_ids(audio_bos_token)
        self.audio_eos_token_id = tokenizer.convert_tokens_to_ids(audio_eos_token)
        self.hop_length = hop_length
        self.subsample_factor = subsample_factor
        self.chat_template = chat_template

    @property
    def sampling_rate(self) -> int:
        """The rate clips must have (the feature extractor's)."""
        return int(self.feature_extractor.sampling_rate)

    def token_count(self, num_samples: int) -> int:
        """``<|AUDIO|>`` tokens for a clip of ``num_samples`` (after padding to the minimum)."""
        frames = 1 + num_samples // self.hop_length
        return max(1, frames // ENCODER_TIME_STRIDE // self.subsample_factor)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """The tokenizer's chat template call, with the folder's template."""
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def _expand(self, text: str, lengths: Sequence[int]) -> str:
        """Each ``<|AUDIO|>`` of ``text``, in order, as its clip's tokens (wrapped if bare)."""
        pieces = text.split(self.audio_token)
        if len(pieces) - 1 != len(lengths):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} {self.audio_token} but {len(lengths)} audio "
                "clips were given"
            )
        out = [pieces[0]]
        for index, length in enumerate(lengths):
            before, after = out[-1], pieces[index + 1]
            tokens = self.audio_token * self.token_count(length)
            if not before.endswith(self.audio_bos_token) and not after.startswith(
                self.audio_eos_token
            ):
                tokens = self.audio_bos_token + tokens + self.audio_eos_token
            out += [tokens, after]
        return "".join(out)

    def __call__(
        self,
        text: str | Sequence[str],
        audio: Sequence[Any] | None = None,
        *,
        sampling_rate: int | None = None,
        return_tensors: str | None = "pt",
    ) -> dict[str, Any]:
        """Tokenise ``text`` (one prompt) with its ``<|AUDIO|>`` expanded for ``audio``.

        Returns ``input_ids`` and ``attention_mask`` (batch of one), and with audio
        ``input_values`` (float32, ``(clips, longest)``, zero-padded at the end) and
        ``audio_length`` (int64, each clip's sample count).
        """
        prompts = [text] if isinstance(text, str) else list(text)
        if len(prompts) != 1:
            raise ValueError(f"one prompt per call, got {len(prompts)}")
        if sampling_rate is not None and int(sampling_rate) != self.sampling_rate:
            raise ValueError(
                f"audio must be at {self.sampling_rate} Hz (the feature extractor's rate), "
                f"got {sampling_rate}"
            )
        clips = []
        for index, clip in enumerate(audio or ()):
            array = np.asarray(clip, dtype=np.float32)
            if array.ndim != 1:
                raise ValueError(f"audio clip {index} must be mono (1-D), got shape {array.shape}")
            if len(array) < MIN_SAMPLES:
                array = np.pad(array, (0, MIN_SAMPLES - len(array)))
            clips.append(array)
        outputs: dict[str, Any] = {}
        if clips:
            features = self.feature_extractor(
                clips,
                sampling_rate=self.sampling_rate,
                padding=True,
                return_attention_mask=True,
                return_tensors="np",
            )
            outputs["input_values"] = torch.from_numpy(
                np.ascontiguousarray(features["input_values"], dtype=np.float32)
            )
            lengths = features["attention_mask"].sum(-1).astype(np.int64)
            outputs["audio_length"] = torch.from_numpy(lengths)
            prompts = [self._expand(prompts[0], lengths.tolist())]
        elif self.audio_token in prompts[0]:
            raise ValueError(f"the prompt has {self.audio_token} but no audio clip was given")
        encoded = self.tokenizer(prompts, return_tensors=return_tensors)
        return {
            "input_ids": encoded["input_ids"],
            "attention_mask": encoded["attention_mask"],
            **outputs,
        }
