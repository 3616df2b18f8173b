"""The context every model hook receives."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mmproc.errors import ProcessorLoadError

__all__ = ["ModelContext", "read_model_config"]


@dataclass(frozen=True)
class ModelContext:
    """What a model hook knows about the model it serves.

    ``architecture`` is the name it was looked up by; ``model_path`` the local model folder (None
    when looked up by architecture name alone); ``config`` the folder's ``config.json``;
    ``options`` the processor options given to :func:`mmproc.get_processor` (read-only);
    ``plugin`` the name of the plugin serving it.
    """

    architecture: str
    model_path: Path | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    plugin: str = ""

    def __post_init__(self) -> None:
        # Hooks run on several threads; read-only views keep one from changing another's view.
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def option(self, name: str, default: Any = None) -> Any:
        """The processor option ``name``, or ``default`` when it was not given."""
        return self.options.get(name, default)

    def require_model_path(self) -> Path:
        """The model folder, or a clear error when the model was looked up by name alone."""
        if self.model_path is None:
            raise ProcessorLoadError(
                f"{self.architecture} (plugin {self.plugin!r}) needs a local model folder: "
                "pass the folder to get_processor() instead of the architecture name"
            )
        return self.model_path


def read_model_config(folder: Path) -> dict[str, Any]:
    """Read ``folder/config.json``; errors name the folder and what is wrong with the file."""
    path = folder / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProcessorLoadError(f"{folder} is not a model folder: it has no config.json") from None
    except OSError as exc:
        raise ProcessorLoadError(f"cannot read {path}: {exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProcessorLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ProcessorLoadError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config
