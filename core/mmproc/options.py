"""The processor options: the core's, typed and checked, and a plugin's own, checked by name.

:func:`mmproc.get_processor` takes the core's options as keyword arguments (collected here in a
:class:`ProcessorOptions`) and passes any other keyword through as a plugin option, once the
model's ``extra_options`` hook names it: an option nobody reads is refused, with a "did you
mean", rather than silently doing nothing.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from mmproc.errors import ConfigurationError
from mmproc.hashing import DEFAULT_HASH_ALGORITHM, check_hash_algorithm
from mmproc.media import (
    AudioFormat,
    MediaFormat,
    MediaLimits,
    MediaOptions,
    RemoteMedia,
    VideoSampling,
    allowed_media_paths_from_env,
)

__all__ = [
    "CORE_OPTION_NAMES",
    "DEFAULT_MAX_PROMPT_CHARS",
    "DEFAULT_MAX_PROMPT_TOKENS",
    "LOOKUP_OPTION_NAMES",
    "ProcessorOptions",
    "check_plugin_options",
]

WarmUp = Literal["background"] | bool
WorkerKind = Literal["thread", "process"]


DEFAULT_MAX_PROMPT_CHARS = 1 << 22
"""The longest text prompt by default (4 Mi characters, about a million tokens): tokenising it
takes a few seconds of one thread, so a client cannot hold the processor much longer."""

DEFAULT_MAX_PROMPT_TOKENS = 1 << 20
"""The longest prompt by default, in tokens before expansion (beyond any model's context)."""


def _count_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(f"{name} must be an integer >= 1 or None, got {value!r}")


@dataclass(frozen=True)
class ProcessorOptions:
    """The core's processor options (the keyword arguments of :func:`mmproc.get_processor`).

    ``workers``
        preprocessing threads (default: 2 on the CPU path, 1 on the device path; env
        ``MMPROC_WORKERS``).
    ``io_workers``
        media-loading threads (default 4; env ``MMPROC_IO_WORKERS``).
    ``device``
        where a torchvision ("fast") image processor runs (default ``"cpu"``).
    ``device_normalize``
        ship raw uint8 pixels for the engine to normalise: ``None`` (default) when the plugin
        supports it, ``True`` insists, ``False`` normalises on the CPU.
    ``cache_bytes``
        processor-output cache size (default 4 GiB or env ``MMPROC_CACHE_BYTES``; 0 disables).
    ``hf_prompt_expansion``
        let the HF processor expand the placeholders of a text prompt when no item is cached.
    ``warm_up``
        when to make the workers' processor clones: ``"background"`` (default: right away,
        without blocking), ``True`` (before returning), ``False`` (on each worker's first task).
    ``hf_processor_kwargs``
        extra keyword arguments for the HF processor's ``from_pretrained``.
    ``hash_algorithm``
        ``"blake3"`` (default, cryptographic) or ``"xxh3"`` (faster; trusted clients only), for
        item hashes and cache keys (see :mod:`mmproc.hashing`).
    ``allowed_media_paths``
        directories local media files must be inside (after resolving symlinks and ``..``);
        ``[]`` refuses every path; default: env ``MMPROC_ALLOWED_MEDIA_PATHS``, else any path. A
        server taking requests from untrusted clients sets it.
    ``remote_media``
        a :class:`mmproc.media.RemoteMedia` to fetch ``http(s)://`` items (allowed domains,
        public addresses only, limits); default ``None``: URLs are refused.
    ``media_limits``
        a :class:`mmproc.media.MediaLimits`: bytes and time per item read, video and audio
        duration, video frames, decoded bytes per request (default: its defaults).
    ``video_sampling``
        a :class:`mmproc.media.VideoSampling` for video files, over the model's own (its plugin's
        ``media_format``) and the default 2 fps.
    ``max_prompt_chars``
        the longest text prompt, in characters, refused before it is tokenised (default
        :data:`DEFAULT_MAX_PROMPT_CHARS`; ``None``: no limit).
    ``max_prompt_tokens``
        the longest prompt in tokens before its placeholders are expanded, text or token ids
        (default :data:`DEFAULT_MAX_PROMPT_TOKENS`; ``None``: no limit).
    ``worker_kind``
        ``"thread"`` (default): workers are threads of this process, each with its processor
        clone; ``"process"``: the HF processor calls go to as many worker processes
        (:mod:`mmproc.process_workers`), each call to the next idle one, for hosts with more
        cores than one interpreter uses.
    ``worker_timeout_s``
        with process workers, the longest one HF call may run before its worker is stopped and
        replaced (default 300 s; ``None``: no limit).
    ``max_items_per_request``
        ``{modality: n}``: the most items of a modality one request may have, refused before
        any is read (default: no count limit; ``MediaLimits.max_request_decoded_bytes`` still
        bounds what they may cost).
    """

    workers: int | None = None
    io_workers: int | None = None
    device: Any = "cpu"
    device_normalize: bool | None = None
    cache_bytes: int | None = None
    hf_prompt_expansion: bool = False
    warm_up: WarmUp = "background"
    hf_processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    allowed_media_paths: Sequence[str | os.PathLike[str]] | None = None
    remote_media: RemoteMedia | None = None
    media_limits: MediaLimits | None = None
    video_sampling: VideoSampling | None = None
    max_prompt_chars: int | None = DEFAULT_MAX_PROMPT_CHARS
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS
    max_items_per_request: Mapping[str, int] | None = None
    worker_kind: WorkerKind = "thread"
    worker_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        _count_or_none("workers", self.workers)
        _count_or_none("io_workers", self.io_workers)
        if self.worker_kind not in ("thread", "process"):
            raise ConfigurationError(
                f"worker_kind must be 'thread' or 'process', got {self.worker_kind!r}"
            )
        if self.worker_timeout_s is not None and (
            isinstance(self.worker_timeout_s, bool)
            or not isinstance(self.worker_timeout_s, int | float)
            or not self.worker_timeout_s > 0
        ):
            raise ConfigurationError(
                f"worker_timeout_s must be a positive number or None, got {self.worker_timeout_s!r}"
            )
        _count_or_none("max_prompt_chars", self.max_prompt_chars)
        _count_or_none("max_prompt_tokens", self.max_prompt_tokens)
        limits = self.max_items_per_request
        if limits is not None:
            from mmproc.media.items import MODALITIES

            if not isinstance(limits, Mapping) or not all(
                modality in MODALITIES and isinstance(n, int) and not isinstance(n, bool) and n >= 0
                for modality, n in limits.items()
            ):
                raise ConfigurationError(
                    "max_items_per_request must map modalities "
                    f"({', '.join(MODALITIES)}) to counts >= 0, got {limits!r}"
                )
            object.__setattr__(self, "max_items_per_request", MappingProxyType(dict(limits)))
        if self.device_normalize not in (None, True, False):
            raise ConfigurationError(
                f"device_normalize must be True, False or None, got {self.device_normalize!r}"
            )
        if self.cache_bytes is not None and (
            isinstance(self.cache_bytes, bool)
            or not isinstance(self.cache_bytes, int)
            or self.cache_bytes < 0
        ):
            raise ConfigurationError(
                f"cache_bytes must be an integer >= 0 or None, got {self.cache_bytes!r}"
            )
        if not isinstance(self.hf_prompt_expansion, bool):
            raise ConfigurationError(
                f"hf_prompt_expansion must be True or False, got {self.hf_prompt_expansion!r}"
            )
        if self.warm_up not in (True, False, "background"):
            raise ConfigurationError(
                f"warm_up must be True, False or 'background', got {self.warm_up!r}"
            )
        kwargs = self.hf_processor_kwargs if self.hf_processor_kwargs is not None else {}
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ConfigurationError(
                f"hf_processor_kwargs must be a mapping of argument names, got {kwargs!r}"
            )
        object.__setattr__(self, "hf_processor_kwargs", MappingProxyType(dict(kwargs)))
        try:
            check_hash_algorithm(self.hash_algorithm)
        except ValueError as exc:
            raise ConfigurationError(f"hash_algorithm: {exc}") from None
        for name, kind in (
            ("remote_media", RemoteMedia),
            ("media_limits", MediaLimits),
            ("video_sampling", VideoSampling),
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ConfigurationError(
                    f"{name} must be a mmproc.media.{kind.__name__} or None, got {value!r}"
                )

    def media_options(self, model_format: MediaFormat) -> MediaOptions:
        """How this processor loads media: these options over the model's format and the
        defaults (``allowed_media_paths`` unset reads ``MMPROC_ALLOWED_MEDIA_PATHS``)."""
        paths = self.allowed_media_paths
        return MediaOptions(
            video=self.video_sampling or model_format.video or VideoSampling(),
            audio=model_format.audio or AudioFormat(),
            limits=self.media_limits or MediaLimits(),
            remote=self.remote_media,
            allowed_paths=(
                allowed_media_paths_from_env() if paths is None else tuple(map(Path, paths))
            ),
        )

    def output_affecting(self) -> dict[str, Any]:
        """The options that can change what the processor outputs for an item (cache key part).

        The others decide how many threads, when clones are made, how big the cache is, which
        path expands the prompt (both give identical results), or are keyed on their own
        (raw pixels; the hash algorithm decides the function every key is made with).
        """
        return {"device": str(self.device), "hf_processor_kwargs": dict(self.hf_processor_kwargs)}


CORE_OPTION_NAMES: frozenset[str] = frozenset(f.name for f in fields(ProcessorOptions))
"""The names of the core's options."""

LOOKUP_OPTION_NAMES: frozenset[str] = frozenset({"prefer", "model_path", "registry"})
"""Keywords of :func:`mmproc.get_processor` that pick the model rather than configure it."""


def check_plugin_options(
    given: Collection[str], plugin_options: Collection[str], *, model: str
) -> None:
    """Refuse option names neither the core nor the plugin reads, with a "did you mean".

    ``given`` are the keyword arguments that were not core options; ``plugin_options`` the names
    the model's ``extra_options`` hook gave; ``model`` names the model and plugin in the message.
    """
    unknown = sorted(set(given) - set(plugin_options))
    if not unknown:
        return
    vocabulary = sorted(CORE_OPTION_NAMES | LOOKUP_OPTION_NAMES | set(plugin_options))
    described = []
    for name in unknown:
        close = difflib.get_close_matches(name, vocabulary, n=1)
        described.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise ConfigurationError(
        f"unknown processor option{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(described)} for {model}; known options: {', '.join(vocabulary)}"
    )
