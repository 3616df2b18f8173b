"""One error hierarchy for everything mmproc raises on purpose.

Every message names what was wrong: the plugin, the architecture, the media item (modality and
index), the wire frame. Callers catch ``MmprocError`` to handle any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ConfigurationError",
    "DecodeError",
    "EncodeError",
    "FieldSpecError",
    "IncompatiblePluginError",
    "MediaItemError",
    "MmprocError",
    "PluginConflictError",
    "PluginError",
    "PluginLoadError",
    "PluginSpecError",
    "ProcessingError",
    "ProcessorLoadError",
    "PromptUpdateError",
    "UnknownArchitectureError",
]


class MmprocError(Exception):
    """Base class of every error mmproc raises on purpose."""


class ConfigurationError(MmprocError, ValueError):
    """A setting (argument or environment variable) has a value mmproc cannot use."""


# --- plugins and the registry -------------------------------------------------------------------


class PluginError(MmprocError):
    """Something is wrong with a plugin; ``plugin`` names it."""

    def __init__(self, message: str, *, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


class PluginLoadError(PluginError):
    """A plugin's entry point failed to import or its registration hook raised."""

    def __init__(
        self,
        plugin: str,
        *,
        distribution: str | None,
        version: str | None,
        cause: BaseException,
    ) -> None:
        where = f"{distribution} {version}" if distribution else "unknown distribution"
        super().__init__(
            f"plugin {plugin!r} ({where}) failed to load: {type(cause).__name__}: {cause}",
            plugin=plugin,
        )
        self.distribution = distribution
        self.version = version
        self.cause = cause


class IncompatiblePluginError(PluginError):
    """A plugin targets a plugin API this core does not provide."""


class PluginSpecError(PluginError):
    """A plugin's hook implementations do not match the hook specifications."""


class PluginConflictError(PluginError):
    """Two or more plugins claim the same architecture and no preference picks one."""

    def __init__(self, architecture: str, plugins: Sequence[str]) -> None:
        names = ", ".join(sorted(plugins))
        super().__init__(
            f"architecture {architecture!r} is claimed by several plugins: {names}. "
            f'Pick one with MMPROC_PREFER="{architecture}=<plugin>" or '
            f"get_processor(..., prefer={{{architecture!r}: '<plugin>'}})"
        )
        self.architecture = architecture
        self.plugins = tuple(sorted(plugins))


class UnknownArchitectureError(PluginError, LookupError):
    """No loaded plugin serves the architecture that was asked for."""

    def __init__(
        self,
        architecture: str,
        registered: Sequence[str],
        claimed_by_failed: Sequence[str] = (),
        not_loaded: Sequence[str] = (),
    ) -> None:
        lines = [f"no plugin serves architecture {architecture!r}."]
        if claimed_by_failed:
            lines.append(
                "It was claimed by plugins that then failed to load: "
                + "; ".join(claimed_by_failed)
                + "."
            )
        elif not_loaded:
            lines.append(
                "Plugins that are not loaded, so what they serve is unknown: "
                + "; ".join(not_loaded)
                + "."
            )
        lines.append(
            "Registered: " + (", ".join(sorted(registered)) if registered else "(none)") + "."
        )
        lines.append("Run `mmproc plugins` to see every plugin and its status.")
        super().__init__(" ".join(lines))
        self.architecture = architecture
        self.registered = tuple(sorted(registered))
        self.claimed_by_failed = tuple(claimed_by_failed)
        self.not_loaded = tuple(not_loaded)

    def __str__(self) -> str:  # LookupError would repr() the message otherwise
        return str(self.args[0])


class ProcessorLoadError(MmprocError):
    """The HF processor of a model folder could not be built."""


# --- requests ---------------------------------------------------------------------------------


class MediaItemError(MmprocError, ValueError):
    """A media item in a request is unusable; names its modality, index and the cause."""

    def __init__(self, modality: str, index: int | None, reason: str) -> None:
        # index None: the problem is the modality itself (an unknown key), not one item
        super().__init__(f"{modality} item {index}: {reason}" if index is not None else reason)
        self.modality = modality
        self.index = index
        self.reason = reason


class PromptUpdateError(MmprocError, ValueError):
    """The prompt and the media items do not line up (placeholders vs items)."""

    def __init__(self, message: str, *, modality: str | None = None, item_index: int | None = None):
        super().__init__(message)
        self.modality = modality
        self.item_index = item_index


class FieldSpecError(MmprocError):
    """A model's field specification does not cover or fit the processor outputs."""


class ProcessingError(MmprocError):
    """The model's processor failed on a request; the message names the plugin and model."""


# --- the wire ---------------------------------------------------------------------------------


class EncodeError(MmprocError, TypeError):
    """An object cannot be put on the wire (unsupported type, bad key)."""


class DecodeError(MmprocError, ValueError):
    """A received message is malformed; says what was wrong (and which frame)."""
