"""The core's own implementations of the model hooks, registered ``trylast``.

A model implements only what differs from these. Hooks with no sensible default
(``get_mm_fields``, ``get_prompt_updates``, ``get_dummy_text``) have none here: the facade in
:mod:`mmproc.model_hooks` reports a model that leaves one out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from mmproc.context import ModelContext, ProcessingMode
from mmproc.errors import ProcessorLoadError
from mmproc.hookspecs import hookimpl

__all__ = [
    "HF_MODALITY_KWARGS",
    "DefaultModel",
    "read_chat_template",
    "read_json_object",
    "video_kwargs",
]

#: The keyword an HF processor takes each modality's items under.
HF_MODALITY_KWARGS: Mapping[str, str] = {"image": "images", "video": "videos", "audio": "audio"}


@overload
def read_json_object(
    ctx: ModelContext, name: str, *, required: Literal[True] = True
) -> dict[str, Any]: ...
@overload
def read_json_object(ctx: ModelContext, name: str, *, required: bool) -> dict[str, Any] | None: ...
def read_json_object(
    ctx: ModelContext, name: str, *, required: bool = True
) -> dict[str, Any] | None:
    """The JSON object in the model folder's file ``name`` (``preprocessor_config.json``, ...).

    For plugins that read a folder's settings themselves. A file that is missing (when
    ``required``; else ``None`` comes back), unreadable, not JSON or not an object is a
    :class:`~mmproc.errors.ProcessorLoadError` naming the model, the plugin and the file.
    """
    folder = ctx.require_model_path()
    path = folder / name
    where = f"{ctx.architecture} (plugin {ctx.plugin!r})"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if not required:
            return None
        raise ProcessorLoadError(f"{where}: {folder} has no {name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProcessorLoadError(f"{where}: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ProcessorLoadError(f"{where}: {path} must hold a JSON object")
    return data


def read_chat_template(folder: Path) -> str | None:
    """The chat template a model folder stores (``chat_template.jinja`` or ``.json``), if any.

    For plugins that assemble a processor from its parts: transformers' tokenizer does not read
    ``chat_template.json``, only its processor classes do.
    """
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        try:
            template = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ProcessorLoadError(f"{as_json} is not a JSON object: {exc}") from exc
        return template if isinstance(template, str) else None
    return None


def video_kwargs(videos: Sequence[Any]) -> dict[str, Any]:
    """The HF processor keywords for video items (:class:`mmproc.inputs.VideoItem`).

    ``videos``: the frames. When some video came from a file, also ``video_metadata`` (what
    transformers' video processors read: source fps, frame count, the sampled frames' indices,
    from which e.g. Qwen2.5-VL's ``second_per_grid_ts`` comes) and ``do_sample_frames=False``:
    mmproc sampled the frames already. Frames given decoded get the metadata transformers itself
    assumes for them.
    """
    kwargs: dict[str, Any] = {"videos": [video.frames for video in videos]}
    if any(video.metadata is not None for video in videos):
        kwargs["video_metadata"] = [
            video.metadata.to_transformers()
            if video.metadata is not None
            else {
                "total_num_frames": len(video.frames),
                "fps": None,
                "duration": None,
                "frames_indices": list(range(len(video.frames))),
                "height": video.frames.shape[1],
                "width": video.frames.shape[2],
            }
            for video in videos
        ]
        kwargs["do_sample_frames"] = False
    return kwargs


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
                f"{ctx.architecture} (plugin {ctx.plugin!r}): cannot build the HF processor "
                f"from {folder}: {type(exc).__name__}: {exc}"
            ) from exc
        # AutoProcessor falls back to the bare tokenizer when it finds no processor for the
        # folder: never what a multimodal model needs, and a confusing failure later.
        if not any(
            hasattr(processor, part)
            for part in ("image_processor", "video_processor", "feature_extractor")
        ):
            raise ProcessorLoadError(
                f"{ctx.architecture} (plugin {ctx.plugin!r}): transformers' AutoProcessor found "
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
                kwargs.update(video_kwargs(items))
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
