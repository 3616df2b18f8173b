"""The MiDashengLM model hooks: audio clips, 0.2 s per token.

Each clip is ``<|audio_bos|><|AUDIO|><|audio_eos|>`` in a prompt; ``<|AUDIO|>`` expands to the
clip's token count (:meth:`MiDashengLMProcessor.token_count`) and a bare one is wrapped, as the
model's processor does (:mod:`mmproc_midashenglm.processor`). Outputs per clip: ``input_values``
(its waveform, float32; batches pad them) and ``audio_length`` (its sample count, int64). Audio
reaches the hooks as the model needs it: mono, at the feature extractor's rate (``media_format``;
other rates are resampled, stereo is downmixed by the channel mean).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mmproc.plugin import (
    AudioFormat,
    BatchedField,
    FieldSpec,
    MediaFormat,
    ModelContext,
    PaddedField,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    hookimpl,
)

from mmproc_midashenglm.loading import load_midashenglm_processor

__all__ = ["AUDIO_PLACEHOLDER", "MiDashengLMModel"]

AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"


class MiDashengLMModel:
    """Hooks for ``MiDashengLMModel``."""

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Rebuilt from the folder's JSON (see :mod:`mmproc_midashenglm.loading`)."""
        return load_midashenglm_processor(ctx)

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat:
        """Mono waveforms at the feature extractor's rate (16 kHz)."""
        return MediaFormat(audio=AudioFormat(sample_rate=processor.sampling_rate, mono=True))

    @hookimpl
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """One ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip; the model takes no images."""
        return AUDIO_PLACEHOLDER * mm_counts.get("audio", 0)

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """Waveforms cut to each clip's length (a batch pads them); lengths one per clip."""
        return {
            "input_values": PaddedField("audio", "audio_length"),
            "audio_length": BatchedField("audio"),
        }

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """``<|AUDIO|>`` becomes the clip's tokens; its markers are added where both are missing.

        Four forms of a clip's placeholder, as the model's processor treats them: wrapped, with
        only its ``<|audio_bos|>``, with only its ``<|audio_eos|>``, bare (wrapped now). Only the
        ``<|AUDIO|>`` positions receive embeddings.
        """
        clips = item_outputs.get("audio", [])
        audio = processor.audio_token_id
        bos, eos = processor.audio_bos_token_id, processor.audio_eos_token_id

        def tokens(index: int) -> list[int]:
            return [audio] * processor.token_count(int(clips[index]["audio_length"]))

        def content(with_bos: bool, with_eos: bool) -> Any:
            def make(index: int) -> PromptUpdateDetails:
                full = [bos] * with_bos + tokens(index) + [eos] * with_eos
                return PromptUpdateDetails.select_token_id(full, audio)

            return make

        return [
            PromptReplacement("audio", [bos, audio, eos], content(True, True)),
            PromptReplacement("audio", [bos, audio], content(True, False)),
            PromptReplacement("audio", [audio, eos], content(False, True)),
            PromptReplacement("audio", [audio], content(True, True)),
        ]
