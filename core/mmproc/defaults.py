"""The core's own implementations of the model hooks, registered ``trylast``.

A model implements only what differs from these. Hooks with no sensible default
(``get_mm_fields``, ``get_prompt_updates``, ``get_dummy_text``) have none here: the facade in
:mod:`mmproc.model_hooks` reports a model that leaves one out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mmproc.context import ModelContext, ProcessingMode
from mmproc.errors import ProcessorLoadError
from mmproc.hookspecs import hookimpl
from mmproc.model_folder import HF_MODALITY_KWARGS, hf_video_kwargs

__all__ = ["DefaultModel"]

# Processor classes that refused media without text (learned on the first refusal): they get
# the dummy text. A set of types: adding is atomic, so worker threads may learn at once.
_NEEDS_TEXT: set[type] = set()


class DefaultModel:
    """Defaults every model gets; each runs only when the model's own hook gives no answer."""

    @hookimpl(trylast=True)
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """transformers' ``AutoProcessor`` from the local folder, never the hub."""
        folder = ctx.require_model_path()
        from transformers import AutoProcessor

        kwargs = dict(ctx.processor_options.hf_processor_kwargs)
        try:
            processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, **kwargs)
        except Exception as exc:
            raise ProcessorLoadError(
                f"{ctx.model_name}: cannot build the HF processor "
                f"from {folder}: {type(exc).__name__}: {exc}"
            ) from exc
        # AutoProcessor falls back to the bare tokenizer when it finds no processor for the
        # folder: never what a multimodal model needs, and a confusing failure later.
        if not any(
            hasattr(processor, part)
            for part in ("image_processor", "video_processor", "feature_extractor")
        ):
            raise ProcessorLoadError(
                f"{ctx.model_name}: transformers' AutoProcessor found "
                f"no image, video or audio processor in {folder} (it gave a "
                f"{type(processor).__name__}); config.json's model_type "
                f"{ctx.config.get('model_type')!r} must be one transformers knows, with the "
                "processor files it reads, or the plugin loads the processor itself in its "
                "load_hf_processor hook"
            )
        return processor

    @hookimpl(trylast=True)
    def process_mm_data(
        self,
        ctx: ModelContext,
        mode: ProcessingMode,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        """Call the processor with each modality under its HF keyword, and the prompt.

        With ``mode.media_only`` the prompt is dummy text whose ids the core does not use, so
        the processor runs on the media alone: tokenising text with every placeholder expanded
        costs as much as a fifth of the call. A processor that refuses media without text gets
        the text, and its class gets it from then on. ``hf_kwargs`` already realise the rest
        of ``mode`` (the core adds the raw-pixel switches and the device).
        """
        kwargs: dict[str, Any] = {"return_tensors": "pt"}
        for modality, items in mm_items.items():
            if not items:
                continue
            if modality == "audio":
                kwargs["audio"] = [item.waveform for item in items]
                rates = {item.sample_rate for item in items}
                if len(rates) == 1:
                    kwargs.setdefault("sampling_rate", rates.pop())
            elif modality == "video":
                kwargs.update(hf_video_kwargs(items))
            else:
                kwargs[HF_MODALITY_KWARGS.get(modality, modality)] = list(items)
        kwargs.update(hf_kwargs)
        if mode.media_only and type(processor) not in _NEEDS_TEXT:
            try:
                return processor(**kwargs)
            except Exception as media_alone:
                try:
                    outputs = processor(text=[prompt], **kwargs)
                except Exception:
                    raise media_alone from None  # the items are at fault, not the missing text
                _NEEDS_TEXT.add(type(processor))
                return outputs
        return processor(text=[prompt], **kwargs)

    @hookimpl(trylast=True)
    def extra_options(self, ctx: ModelContext) -> Iterable[str]:
        """No options beyond the core's."""
        return ()

    @hookimpl(trylast=True)
    def supports_concurrency(self, ctx: ModelContext) -> bool:
        """Per-thread deep copies make every processor safe to run concurrently by default."""
        return True
