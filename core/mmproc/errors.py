"""One error hierarchy for everything mmproc raises on purpose.

Every message names what was wrong: the plugin, the architecture, the media item (modality and
index), the chat message and part, the wire frame. Callers catch ``MmprocError`` to handle any
of them::

    MmprocError
    ├── ConfigurationError           a setting mmproc cannot use (also a ValueError)
    ├── PluginError                  a plugin, named in .plugin
    │   ├── PluginLoadError          its entry point failed to import or register
    │   ├── IncompatiblePluginError  it targets another plugin API
    │   ├── PluginSpecError          its hooks do not match the specifications
    │   ├── PluginConflictError      several plugins claim one architecture
    │   └── UnknownArchitectureError no plugin serves it (also a LookupError)
    ├── ProcessorLoadError           a model folder's HF processor cannot be built
    ├── MediaItemError               a request's media item: .modality, .index
    ├── PromptUpdateError            the prompt and the items do not line up
    ├── ChatRequestError             a chat request's message or part: .message_index, .part_index,
    │                                or another field of it: .field
    │   └── ChatTemplateError        the chat template failed to render it
    ├── FieldSpecError               a model's fields do not fit its outputs
    ├── ProcessingError              the model's processor failed on a request
    │   └── WorkerProcessError       a worker process failed to start, died or ran out of time
    ├── EncodeError                  an object cannot go on the wire (also a TypeError)
    └── DecodeError                  a received message is malformed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "ChatRequestError",
    "ChatTemplateError",
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
    "WorkerProcessError",
]


class MmprocError(Exception):
    """Base class of every error mmproc raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its message and attributes, rebuilt without calling __init__: the errors'
        # own __init__ take other arguments than the message, so the default (calling the class
        # with ``args``) fails or composes the message twice. Process workers send errors back.
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type[MmprocError], args: tuple[Any, ...], state: dict[str, Any]) -> MmprocError:
    """An error unpickled: ``cls`` with the ``args`` and attributes it was pickled with."""
    error = cls.__new__(cls, *args)
    error.__dict__.update(state)
    return error


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


class ChatRequestError(MmprocError, ValueError):
    """A chat request is unusable: names the message and the part (by index) that is wrong.

    ``message_index`` and ``part_index`` are ``None`` when the problem is not one message or one
    part (the messages are not a list; the template refused the conversation as a whole). For a
    media part, ``modality`` and ``item_index`` say which item of the request it became. When
    the problem is a field of the request other than a message, ``field`` names it as a client
    wrote it (``"tools[2]"``, ``"documents"``, ``"continue_final_message"``).
    """

    def __init__(
        self,
        message: str,
        *,
        message_index: int | None = None,
        part_index: int | None = None,
        modality: str | None = None,
        item_index: int | None = None,
        field: str | None = None,
    ) -> None:
        where = ""
        if message_index is not None:
            where = f"message {message_index}"
            if part_index is not None:
                where += f", part {part_index}"
            where += ": "
        super().__init__(where + message)
        self.message_index = message_index
        self.part_index = part_index
        self.modality = modality
        self.item_index = item_index
        self.field = field


class ChatTemplateError(ChatRequestError):
    """The chat template failed to render the conversation (its own ``raise_exception``, an
    error in the template, or a variable it needs)."""


class FieldSpecError(MmprocError):
    """A model's field specification does not cover or fit the processor outputs."""


class ProcessingError(MmprocError):
    """The model's processor failed on a request; the message names the plugin and model."""


class WorkerProcessError(ProcessingError):
    """A worker process (``worker_kind="process"``) could not start, died, or ran past
    ``worker_timeout_s`` while it processed a request's items (it is replaced), or there was no
    shared memory to hand it a request's items or outputs; only that request fails."""


# --- the wire ---------------------------------------------------------------------------------


class EncodeError(MmprocError, TypeError):
    """An object cannot be put on the wire (unsupported type, bad key)."""


class DecodeError(MmprocError, ValueError):
    """A received message is malformed; says what was wrong (and which frame)."""
