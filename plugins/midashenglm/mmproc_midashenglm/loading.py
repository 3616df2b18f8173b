"""Build MiDashengLM's processor from a local model folder, reading its JSON (never its code).

The feature extractor is transformers' ``Wav2Vec2FeatureExtractor`` with the settings of the
folder's ``preprocessor_config.json``; the model takes raw waveforms, so a folder whose extractor
normalises (``do_normalize``) is refused, as the model's own processor refuses it. The tokenizer
is the folder's (Qwen2's), its audio tokens named by ``tokenizer_config.json`` (``audio_token``,
``audio_bos_token``, ``audio_eos_token``) or else Qwen2-Audio's names; ``config.json`` gives the
mel hop (``audio_encoder_config.hop_length``) and ``subsample_factor``, and its ``audio_token_id``,
when present, must be the tokenizer's id of the audio token.
"""

from __future__ import annotations

from typing import Any

from mmproc.plugin import ModelContext, ProcessorLoadError, read_chat_template, read_json_object

from mmproc_midashenglm.processor import MiDashengLMProcessor

__all__ = ["MODEL_TYPES", "load_midashenglm_processor"]

#: ``config.json`` model types of MiDashengLM folders: today's, and the early uploads'.
MODEL_TYPES = ("midashenglm", "miaudiollm")

_AUDIO_TOKEN_DEFAULTS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}


def _positive_int(ctx: ModelContext, where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProcessorLoadError(
            f"{ctx.architecture} (plugin {ctx.plugin!r}): config.json's {where} must be a "
            f"positive integer, got {value!r}"
        )
    return value


def load_midashenglm_processor(ctx: ModelContext) -> MiDashengLMProcessor:
    """The processor for ``ctx``'s folder."""
    folder = ctx.require_model_path()
    model_type = ctx.config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ProcessorLoadError(
            f"{ctx.architecture} (plugin {ctx.plugin!r}): {folder}/config.json has model_type "
            f"{model_type!r}; MiDashengLM folders say one of {', '.join(MODEL_TYPES)}"
        )
    from transformers import AutoTokenizer, PretrainedConfig, Wav2Vec2FeatureExtractor

    settings = read_json_object(ctx, "preprocessor_config.json")
    if settings.get("do_normalize", True):
        raise ProcessorLoadError(
            f"{ctx.architecture} (plugin {ctx.plugin!r}): {folder}/preprocessor_config.json "
            "asks the feature extractor to normalise (do_normalize), which this model does not "
            'use; set "do_normalize": false, as the model\'s processor requires'
        )
    encoder = ctx.config.get("audio_encoder_config") or {}
    hop = _positive_int(ctx, "audio_encoder_config.hop_length", encoder.get("hop_length", 160))
    subsample = _positive_int(ctx, "subsample_factor", ctx.config.get("subsample_factor", 5))
    kept = {
        k: v for k, v in settings.items() if k not in ("feature_extractor_type", "processor_class")
    }
    feature_extractor = Wav2Vec2FeatureExtractor(**kept)
    # The folder's config names a model transformers does not know: the tokenizer is read
    # from its own files, not through that config.
    tokenizer = AutoTokenizer.from_pretrained(
        str(folder), local_files_only=True, config=PretrainedConfig()
    )
    tokens: dict[str, str] = {}
    for name, default in _AUDIO_TOKEN_DEFAULTS.items():
        own = getattr(tokenizer, name, None)
        tokens[name] = own if isinstance(own, str) else default
    for name, token in tokens.items():
        if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise ProcessorLoadError(
                f"{ctx.architecture} (plugin {ctx.plugin!r}): the folder's tokenizer has no "
                f"{token} ({name})"
            )
    processor = MiDashengLMProcessor(
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        hop_length=hop,
        subsample_factor=subsample,
        chat_template=read_chat_template(folder) or getattr(tokenizer, "chat_template", None),
        **tokens,
    )
    expected = ctx.config.get("audio_token_id")
    if expected is not None and expected != processor.audio_token_id:
        raise ProcessorLoadError(
            f"{ctx.architecture} (plugin {ctx.plugin!r}): config.json's audio_token_id is "
            f"{expected}, but the tokenizer gives {tokens['audio_token']} the id "
            f"{processor.audio_token_id}"
        )
    return processor
