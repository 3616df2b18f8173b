"""mmproc: the multimodal preprocessing layer of LLM serving engines.

Importing mmproc is cheap: it imports neither torch nor transformers nor any plugin. Plugins are
discovered on the first lookup, and the heavy parts load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public names that pull in heavy modules are resolved on first attribute access (PEP 562).
_LAZY: dict[str, str] = {
    "Registry": "mmproc.registry",
    "get_registry": "mmproc.registry",
    "hookimpl": "mmproc.hookspecs",
    "ModelContext": "mmproc.context",
}

__all__ = [
    "ModelContext",
    "Registry",
    "__version__",
    "get_registry",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mmproc' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from mmproc.context import ModelContext
    from mmproc.hookspecs import hookimpl
    from mmproc.registry import Registry, get_registry
