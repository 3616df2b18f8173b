"""``get_processor``: find the plugin serving a model, check the options, build its Processor."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmproc.context import ModelContext, read_model_config
from mmproc.errors import ConfigurationError, ProcessorLoadError
from mmproc.hashing import DEFAULT_HASH_ALGORITHM
from mmproc.model_hooks import load_model_hooks
from mmproc.options import (
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_PROMPT_TOKENS,
    ProcessorOptions,
    WarmUp,
    WorkerKind,
    check_plugin_options,
)
from mmproc.processor import Processor

if TYPE_CHECKING:
    from mmproc.media import MediaLimits, RemoteMedia, VideoSampling
    from mmproc.registry import Registry

__all__ = ["get_processor"]


def get_processor(
    name_or_folder: str | os.PathLike[str],
    *,
    workers: int | None = None,
    io_workers: int | None = None,
    device: Any = "cpu",
    device_normalize: bool | None = None,
    cache_bytes: int | None = None,
    hf_prompt_expansion: bool = False,
    warm_up: WarmUp = "background",
    hf_processor_kwargs: Mapping[str, Any] | None = None,
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
    allowed_media_paths: Sequence[str | os.PathLike[str]] | None = None,
    remote_media: RemoteMedia | None = None,
    media_limits: MediaLimits | None = None,
    video_sampling: VideoSampling | None = None,
    max_prompt_chars: int | None = DEFAULT_MAX_PROMPT_CHARS,
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS,
    max_items_per_request: Mapping[str, int] | None = None,
    worker_kind: WorkerKind = "thread",
    worker_timeout_s: float | None = 300.0,
    prefer: Mapping[str, str] | None = None,
    model_path: str | os.PathLike[str] | None = None,
    registry: Registry | None = None,
    **plugin_options: Any,
) -> Processor:
    """The :class:`~mmproc.processor.Processor` for a local model folder or an architecture name.

    ``name_or_folder`` is a folder holding ``config.json`` (looked up by its ``architectures``)
    or an architecture name (then pass ``model_path=`` for models that load files). The core's
    options are documented on :class:`mmproc.options.ProcessorOptions`; besides them:

    ``prefer``
        ``{architecture: plugin}`` when several plugins claim the architecture.
    ``model_path``
        the model folder, when ``name_or_folder`` is an architecture name.
    ``registry``
        the :class:`mmproc.registry.Registry` to look the model up in (default: the process's).
    ``**plugin_options``
        options of the model's plugin (e.g. ``backend="pil"`` for the Qwen2-VL plugin), which it
        names in its ``extra_options`` hook. Any other keyword is a
        :class:`~mmproc.errors.ConfigurationError` naming it, with a "did you mean".
    """
    from mmproc.registry import get_registry

    options = ProcessorOptions(
        workers=workers,
        io_workers=io_workers,
        device=device,
        device_normalize=device_normalize,
        cache_bytes=cache_bytes,
        hf_prompt_expansion=hf_prompt_expansion,
        warm_up=warm_up,
        hf_processor_kwargs=hf_processor_kwargs or {},
        hash_algorithm=hash_algorithm,
        allowed_media_paths=allowed_media_paths,
        remote_media=remote_media,
        media_limits=media_limits,
        video_sampling=video_sampling,
        max_prompt_chars=max_prompt_chars,
        max_prompt_tokens=max_prompt_tokens,
        max_items_per_request=max_items_per_request,
        worker_kind=worker_kind,
        worker_timeout_s=worker_timeout_s,
    )
    registry = registry or get_registry()
    target = os.fspath(name_or_folder)
    if os.path.isdir(target):
        folder: Path | None = Path(target)
        assert folder is not None
        reference = registry.resolve_folder(folder, prefer=prefer)
        config = read_model_config(folder)
    else:
        if os.sep in target or target.startswith((".", "~")):
            # Architecture names never hold a path separator: this was meant as a folder.
            raise ProcessorLoadError(f"model folder {target} does not exist")
        folder = Path(model_path) if model_path is not None else None
        reference = registry.resolve(target, prefer=prefer)
        config = read_model_config(folder) if folder is not None else {}
    if worker_kind == "process" and (folder is None or registry is not get_registry()):
        raise ConfigurationError(
            "worker_kind='process' needs a model folder and the installed plugins (each worker "
            "process looks the model up again): not an architecture name, nor a registry of "
            "in-process plugins"
        )
    model = load_model_hooks(reference)
    ctx = ModelContext(
        architecture=reference.architecture,
        model_path=folder,
        config=config,
        plugin=reference.plugin,
        processor_options=options,
    )
    check_plugin_options(
        plugin_options,
        model.extra_options(ctx),
        model=f"{reference.architecture} (plugin {reference.plugin!r})",
    )
    ctx = dataclasses.replace(ctx, options=plugin_options)
    spec = None
    if worker_kind == "process":
        from mmproc.process_workers import WorkerSpec

        shaping = {
            "device": device,
            "hf_processor_kwargs": dict(hf_processor_kwargs or {}),
            **({"prefer": dict(prefer)} if prefer else {}),
            **plugin_options,
        }
        spec = WorkerSpec(str(folder), get_processor, shaping)
    return Processor(model, ctx, worker_spec=spec)
