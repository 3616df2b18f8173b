"""What the core tells a model's hooks: the model it serves, and how each processor call is made."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mmproc.errors import ProcessorLoadError

if TYPE_CHECKING:
    from mmproc.options import ProcessorOptions

__all__ = ["ModelContext", "ProcessingMode", "read_model_config"]


def _default_options() -> ProcessorOptions:
    from mmproc.options import ProcessorOptions

    return ProcessorOptions()


@dataclass(frozen=True)
class ModelContext:
    """What a model hook knows about the model it serves.

    ``architecture`` is the name it was looked up by; ``model_path`` the local model folder (None
    when looked up by architecture name alone); ``config`` the folder's ``config.json``;
    ``plugin`` the name of the plugin serving it. ``options`` holds the plugin's own options
    (those its ``extra_options`` hook names) as the caller gave them; ``processor_options`` the
    core's options (:class:`mmproc.options.ProcessorOptions`), e.g. ``hf_processor_kwargs`` for
    a plugin that builds its processor itself. Both are read-only.
    """

    architecture: str
    model_path: Path | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    plugin: str = ""
    processor_options: ProcessorOptions = field(default_factory=_default_options)

    def __post_init__(self) -> None:
        # Hooks run on several threads; read-only views keep one from changing another's view.
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def model_name(self) -> str:
        """How messages name the model: its architecture and the plugin serving it."""
        return f"{self.architecture} (plugin {self.plugin!r})"

    def option(self, name: str, default: Any = None) -> Any:
        """The plugin option ``name``, or ``default`` when the caller did not give it."""
        return self.options.get(name, default)

    def require_model_path(self) -> Path:
        """The model folder, or a clear error when the model was looked up by name alone."""
        if self.model_path is None:
            raise ProcessorLoadError(
                f"{self.model_name} needs a local model folder: "
                "pass the folder to get_processor() instead of the architecture name"
            )
        return self.model_path


@dataclass(frozen=True, slots=True)
class ProcessingMode:
    """How the core calls ``process_mm_data`` this time: a hook reads this, never guesses.

    ``media_only``
        True when ``prompt`` is the model's own dummy text for exactly these items (the cached
        path: the core expands the user's prompt itself afterwards); False when it is the user's
        prompt and the HF processor's expansion of it is used as is (``hf_prompt_expansion``).
    ``raw_pixels``
        True when pixels must come out raw, whole numbers in [0, 255] (rescale and normalise
        off): the engine normalises them (device normalisation, :mod:`mmproc.fused_norm`).
    ``device``
        Where a torchvision ("fast") image processor runs (the ``device`` option).
    ``user_kwargs``
        The keyword arguments the caller gave for the HF processor (the request's
        ``hf_kwargs``), so a hook can tell whether a path of its own honours them all.

    The ``hf_kwargs`` a hook receives are everything to pass to the HF processor: the caller's
    plus what the core adds to realise this mode (the raw-pixel switches, the device).
    """

    media_only: bool
    raw_pixels: bool
    device: Any = "cpu"
    user_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        """``"cpu"``, ``"cuda"``, ...: the kind of ``device`` without its index."""
        text = str(getattr(self.device, "type", self.device)).strip().lower()
        return text.split(":", 1)[0]


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
