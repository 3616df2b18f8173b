"""Cache keys of a processor's items: the context they were processed in, and the item itself.

A key combines a *context digest* (the architecture, the plugin, the model folder's processor
configuration files, every option that can change outputs, the request's ``hf_kwargs``, whether
pixels come out raw, the transformers version) with the item: its content hash
(:func:`mmproc.hashing.hash_item`) for an item given decoded, the hash of its bytes and of how
they are decoded (:func:`mmproc.hashing.hash_encoded`) for an item given encoded, or the id the
caller gave for it.

Caller-given ids (``mm_uuids``, vLLM's ``multi_modal_uuids``): an id is the caller's promise that
equal ids mean equal content. It replaces the content hash in the key (the context stays in it,
so one id under two models or two settings is two entries), and the item is then never hashed: a
cache hit costs no pass over the pixels, and an item whose id is cached need not even be sent
(nor is it checked or decoded when it is).
The processor cannot check the promise. Requests from different clients share the cache, so a
server must accept ids only from callers it trusts, or put each client's ids in a namespace of
their own (prefix them with the client): a client choosing another's id would otherwise be
served that client's item. An id can never equal a content hash (the two are framed apart).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmproc.context import ModelContext
from mmproc.errors import ConfigurationError, MediaItemError
from mmproc.hashing import canonical_json, hash_context, hash_encoded, hash_item, item_key
from mmproc.inputs import check_modalities, decoding_recipe
from mmproc.media.policy import MediaOptions

__all__ = ["MAX_ITEM_ID_LENGTH", "PROCESSOR_CONFIG_FILES", "CacheKeys", "check_mm_uuids"]

PROCESSOR_CONFIG_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
"""Files of a model folder whose content decides the processor's outputs (part of every key)."""

MAX_ITEM_ID_LENGTH = 1024
"""The longest caller-given item id accepted, in characters."""

# Content hashes are hex digits only: an id behind this prefix can never equal one.
_CALLER_ID_PREFIX = "caller-id:"
_MAX_MEMOISED_CONTEXTS = 1024


def check_mm_uuids(
    mm_uuids: Mapping[str, Any] | None, counts: Mapping[str, int]
) -> dict[str, list[str | None]]:
    """The caller's item ids per modality, one id or None per item; bad ids name the item.

    Each modality's value is a list with one entry per item (or, for a single item, the id
    itself); an entry is a non-empty string of at most :data:`MAX_ITEM_ID_LENGTH` characters, or
    None for an item to be hashed by content.
    """
    if mm_uuids is None:
        return {}
    if not isinstance(mm_uuids, Mapping):
        raise MediaItemError(
            "mm_uuids",
            None,
            f"mm_uuids must map modality to item ids, not {type(mm_uuids).__name__}",
        )
    check_modalities(mm_uuids, what="mm_uuids modality")
    ids: dict[str, list[str | None]] = {}
    for modality, value in mm_uuids.items():
        count = counts.get(modality, 0)
        given = [value] if value is None or isinstance(value, str) else value
        if not isinstance(given, Sequence) or isinstance(given, bytes | bytearray):
            raise MediaItemError(
                str(modality),
                None,
                f"mm_uuids[{modality!r}] must be a list of ids, not {type(value).__name__}",
            )
        if len(given) != count:
            raise MediaItemError(
                str(modality),
                None,
                f"mm_uuids has {len(given)} {modality} id{'s' if len(given) != 1 else ''} "
                f"for {count} {modality} item{'s' if count != 1 else ''}",
            )
        for index, item_id in enumerate(given):
            if item_id is None:
                continue
            if not isinstance(item_id, str) or not item_id:
                raise MediaItemError(
                    str(modality), index, f"its id must be a non-empty string, got {item_id!r}"
                )
            if len(item_id) > MAX_ITEM_ID_LENGTH:
                raise MediaItemError(
                    str(modality),
                    index,
                    f"its id is {len(item_id)} characters long, over the limit of "
                    f"{MAX_ITEM_ID_LENGTH}",
                )
        ids[str(modality)] = list(given)
    return ids


def _processor_config(folder: Path | None) -> dict[str, str]:
    if folder is None:
        return {}
    return {
        name: (folder / name).read_text(encoding="utf-8")
        for name in PROCESSOR_CONFIG_FILES
        if (folder / name).is_file()
    }


class CacheKeys:
    """Makes the cache keys (and feature hashes) of one processor's items. Thread-safe."""

    def __init__(self, ctx: ModelContext, algorithm: str, media: MediaOptions) -> None:
        import transformers

        self.algorithm = algorithm
        self._media = media  # how the processor decodes: the recipe of its encoded items
        self._recipes: dict[str, bytes] = {}
        self._ctx = ctx
        self._processor_config = _processor_config(ctx.model_path)
        self._options: dict[str, Any] = {
            **ctx.processor_options.output_affecting(),
            "plugin_options": dict(ctx.options),
            "plugin": ctx.plugin,
            "transformers": transformers.__version__,
        }
        self._digests: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def context_digest(self, hf_kwargs: Mapping[str, Any], raw_pixels: bool) -> bytes:
        """The part of every key that is not the item: model, configuration, options, request
        settings. Options or ``hf_kwargs`` that cannot be keyed are a ``ConfigurationError``."""
        try:
            # The canonical text is the memo key: two kwargs with one text key alike anyway.
            text = canonical_json([hf_kwargs, raw_pixels])
        except TypeError as exc:
            raise ConfigurationError(f"hf_kwargs cannot be part of a cache key: {exc}") from None
        digest = self._digests.get(text)
        if digest is None:
            options = {**self._options, "hf_kwargs": dict(hf_kwargs), "raw_pixels": raw_pixels}
            try:
                digest = hash_context(
                    self._ctx.architecture, self._processor_config, options, self.algorithm
                )
            except TypeError as exc:
                raise ConfigurationError(f"options cannot be part of a cache key: {exc}") from None
            with self._lock:
                if len(self._digests) < _MAX_MEMOISED_CONTEXTS:
                    self._digests[text] = digest
        return digest

    def content_key(self, digest: bytes, modality: str, item: Any) -> str:
        """The key of a parsed item, by its content hash."""
        return item_key(digest, hash_item(modality, item, self.algorithm), self.algorithm)

    def source_key(self, digest: bytes, modality: str, data: bytes) -> str:
        """The key of an item given encoded, by the hash of its bytes and of how they decode."""
        recipe = self._recipes.get(modality)
        if recipe is None:
            recipe = canonical_json(decoding_recipe(modality, self._media)).encode()
            self._recipes[modality] = recipe
        return item_key(
            digest, hash_encoded(modality, data, recipe, self.algorithm), self.algorithm
        )

    def id_key(self, digest: bytes, modality: str, item_id: str) -> str:
        """The key of a ``modality`` item the caller named with ``item_id`` (an image and a
        video named alike are different items)."""
        return item_key(digest, f"{_CALLER_ID_PREFIX}{modality}:{item_id}", self.algorithm)
