"""The face of mmproc for plugin authors: everything a model plugin imports, from one module.

A plugin imports from here and nowhere else in mmproc (its tests may also use
:mod:`mmproc.testing`)::

    from mmproc.plugin import BatchedField, FlatField, PromptReplacement, hookimpl

Importing this module is as light as ``import mmproc``: no torch, transformers, numpy or PIL.
Each name loads its defining module on first use, so a plugin's entry-point module may import
``hookimpl`` from here and stay light (the conformance suite checks that it does).

What is here, by the hooks that use it (:mod:`mmproc.hookspecs` documents every hook):

Declaring hooks
    :data:`hookimpl`; :class:`ModelRegistrar` (what ``mmproc_register_models`` gets);
    :class:`ModelContext` (every hook's ``ctx``), :class:`ProcessingMode` (``process_mm_data``'s
    ``mode``), :class:`PreprocessingPath` (``worker_count_hint``'s ``path``).
The items hooks receive
    :class:`AudioItem`, :class:`VideoItem`, :class:`VideoMetadata`; :func:`hf_video_kwargs` (the
    HF keywords for video items, metadata included) and :data:`HF_MODALITY_KWARGS`;
    :func:`rgb_pixels`, :func:`rgbx_pixels` (an RGB image's pixels read where Pillow holds them).
Making outputs (``process_mm_data``)
    :func:`output_tensor` (a large output the plugin fills itself, made where a worker process
    hands it back without copying it).
Splitting outputs per item (``get_mm_fields``)
    :class:`FieldSpec` (the base class of a field of your own), :class:`BatchedField`,
    :class:`FlatField`, :class:`PaddedField`, :class:`SharedField`.
Prompt updates (``get_prompt_updates``, ``get_prompt_outputs``)
    :class:`PromptReplacement`, :class:`PromptInsertion`, :class:`PromptUpdate`,
    :class:`PromptUpdateDetails`, :class:`PromptIndexTargets`, :class:`PlaceholderRange`.
Device normalisation (``device_norm_spec``)
    :class:`NormSpec`, :class:`ChannelLayout`.
Media the model needs (``media_format``)
    :class:`MediaFormat`, :class:`VideoSampling`, :class:`AudioFormat`,
    :data:`DEFAULT_VIDEO_FPS`.
Reading the model folder (``load_hf_processor``)
    :func:`read_json_object`, :func:`read_chat_template`.
Errors a hook raises
    :class:`MmprocError` (the base), :class:`ConfigurationError` (a bad option),
    :class:`ProcessorLoadError` (a folder the plugin cannot load), :class:`MediaItemError` (an
    item the model cannot take: name its modality and index), :class:`ProcessingError`,
    :class:`FieldSpecError` (outputs that do not fit a field, from a field's ``split``).
Demo models (``registry.register_demo``)
    :func:`build_tokenizer`, :func:`write_model_folder`, :func:`resave_with_processor` (these load
    ``tokenizers`` and transformers when first used).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module defining it, imported on first attribute access (PEP 562).
_LAZY: dict[str, str] = {
    "AudioFormat": "mmproc.media.policy",
    "AudioItem": "mmproc.media.items",
    "BatchedField": "mmproc.fields",
    "ChannelLayout": "mmproc.norm_spec",
    "ConfigurationError": "mmproc.errors",
    "DEFAULT_VIDEO_FPS": "mmproc.media.policy",
    "FieldSpec": "mmproc.fields",
    "FieldSpecError": "mmproc.errors",
    "FlatField": "mmproc.fields",
    "HF_MODALITY_KWARGS": "mmproc.model_folder",
    "MediaFormat": "mmproc.media.policy",
    "MediaItemError": "mmproc.errors",
    "MmprocError": "mmproc.errors",
    "ModelContext": "mmproc.context",
    "ModelRegistrar": "mmproc.registry",
    "NormSpec": "mmproc.norm_spec",
    "PaddedField": "mmproc.fields",
    "PlaceholderRange": "mmproc.prompt_update",
    "PreprocessingPath": "mmproc.worker_count",
    "ProcessingError": "mmproc.errors",
    "ProcessingMode": "mmproc.context",
    "ProcessorLoadError": "mmproc.errors",
    "PromptIndexTargets": "mmproc.prompt_update",
    "PromptInsertion": "mmproc.prompt_update",
    "PromptReplacement": "mmproc.prompt_update",
    "PromptUpdate": "mmproc.prompt_update",
    "PromptUpdateDetails": "mmproc.prompt_update",
    "SharedField": "mmproc.fields",
    "VideoItem": "mmproc.media.items",
    "VideoMetadata": "mmproc.media.items",
    "VideoSampling": "mmproc.media.policy",
    "build_tokenizer": "mmproc.testing.model_folders",
    "hf_video_kwargs": "mmproc.model_folder",
    "hookimpl": "mmproc.hookspecs",
    "output_tensor": "mmproc.output_memory",
    "read_chat_template": "mmproc.model_folder",
    "read_json_object": "mmproc.model_folder",
    "rgb_pixels": "mmproc.media.pillow_pixels",
    "rgbx_pixels": "mmproc.media.pillow_pixels",
    "resave_with_processor": "mmproc.testing.model_folders",
    "write_model_folder": "mmproc.testing.model_folders",
}

__all__ = [
    "DEFAULT_VIDEO_FPS",
    "HF_MODALITY_KWARGS",
    "AudioFormat",
    "AudioItem",
    "BatchedField",
    "ChannelLayout",
    "ConfigurationError",
    "FieldSpec",
    "FieldSpecError",
    "FlatField",
    "MediaFormat",
    "MediaItemError",
    "MmprocError",
    "ModelContext",
    "ModelRegistrar",
    "NormSpec",
    "PaddedField",
    "PlaceholderRange",
    "PreprocessingPath",
    "ProcessingError",
    "ProcessingMode",
    "ProcessorLoadError",
    "PromptIndexTargets",
    "PromptInsertion",
    "PromptReplacement",
    "PromptUpdate",
    "PromptUpdateDetails",
    "SharedField",
    "VideoItem",
    "VideoMetadata",
    "VideoSampling",
    "build_tokenizer",
    "hf_video_kwargs",
    "hookimpl",
    "output_tensor",
    "read_chat_template",
    "read_json_object",
    "resave_with_processor",
    "rgb_pixels",
    "rgbx_pixels",
    "write_model_folder",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mmproc.plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from mmproc.context import ModelContext, ProcessingMode
    from mmproc.errors import (
        ConfigurationError,
        FieldSpecError,
        MediaItemError,
        MmprocError,
        ProcessingError,
        ProcessorLoadError,
    )
    from mmproc.fields import BatchedField, FieldSpec, FlatField, PaddedField, SharedField
    from mmproc.hookspecs import hookimpl
    from mmproc.media.items import AudioItem, VideoItem, VideoMetadata
    from mmproc.media.pillow_pixels import rgb_pixels, rgbx_pixels
    from mmproc.media.policy import DEFAULT_VIDEO_FPS, AudioFormat, MediaFormat, VideoSampling
    from mmproc.model_folder import (
        HF_MODALITY_KWARGS,
        hf_video_kwargs,
        read_chat_template,
        read_json_object,
    )
    from mmproc.norm_spec import ChannelLayout, NormSpec
    from mmproc.output_memory import output_tensor
    from mmproc.prompt_update import (
        PlaceholderRange,
        PromptIndexTargets,
        PromptInsertion,
        PromptReplacement,
        PromptUpdate,
        PromptUpdateDetails,
    )
    from mmproc.registry import ModelRegistrar
    from mmproc.testing.model_folders import (
        build_tokenizer,
        resave_with_processor,
        write_model_folder,
    )
    from mmproc.worker_count import PreprocessingPath
