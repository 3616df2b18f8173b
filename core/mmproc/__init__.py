"""mmproc: the multimodal preprocessing layer of LLM serving engines.

Importing mmproc is cheap: it imports neither torch nor transformers nor any plugin. Plugins are
discovered on the first lookup, and the heavy parts load on first use (PEP 562 lazy attributes).

Typical use::

    import mmproc

    processor = mmproc.get_processor("/models/Qwen2-VL-2B-Instruct")
    inputs = processor.process(prompt, {"image": [image]})
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> module defining it; resolved on first attribute access.
_LAZY: dict[str, str] = {
    "DecodeError": "mmproc.errors",
    "FusedInputNorm": "mmproc.fused_norm",
    "MediaItemError": "mmproc.errors",
    "MmprocError": "mmproc.errors",
    "ModelContext": "mmproc.context",
    "MultiModalFeature": "mmproc.processor",
    "NormSpec": "mmproc.norm_spec",
    "PlaceholderRange": "mmproc.prompt_update",
    "PluginConflictError": "mmproc.errors",
    "ProcessedInputs": "mmproc.processor",
    "ProcessingMode": "mmproc.context",
    "Processor": "mmproc.processor",
    "ProcessorOptions": "mmproc.options",
    "PromptUpdateError": "mmproc.errors",
    "Registry": "mmproc.registry",
    "UnknownArchitectureError": "mmproc.errors",
    "get_processor": "mmproc.factory",
    "get_registry": "mmproc.registry",
    "hookimpl": "mmproc.hookspecs",
}

__all__ = [
    "DecodeError",
    "FusedInputNorm",
    "MediaItemError",
    "MmprocError",
    "ModelContext",
    "MultiModalFeature",
    "NormSpec",
    "PlaceholderRange",
    "PluginConflictError",
    "ProcessedInputs",
    "ProcessingMode",
    "Processor",
    "ProcessorOptions",
    "PromptUpdateError",
    "Registry",
    "UnknownArchitectureError",
    "__version__",
    "get_processor",
    "get_registry",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mmproc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from mmproc.context import ModelContext, ProcessingMode
    from mmproc.errors import (
        DecodeError,
        MediaItemError,
        MmprocError,
        PluginConflictError,
        PromptUpdateError,
        UnknownArchitectureError,
    )
    from mmproc.factory import get_processor
    from mmproc.fused_norm import FusedInputNorm
    from mmproc.hookspecs import hookimpl
    from mmproc.norm_spec import NormSpec
    from mmproc.options import ProcessorOptions
    from mmproc.processor import MultiModalFeature, ProcessedInputs, Processor
    from mmproc.prompt_update import PlaceholderRange
    from mmproc.registry import Registry, get_registry
