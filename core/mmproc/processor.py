"""The request pipeline: ``(prompt, media) -> ProcessedInputs``.

For each request (:meth:`Processor.process`, :meth:`Processor.process_async`):

1. Parse and load the media items (:mod:`mmproc.inputs`), on the IO pool when there are several.
2. Hash each item and combine it with the model, its processor configuration and the options
   that change outputs (:mod:`mmproc.hashing`).
3. Look the hashes up in the processor-output cache; only the missing items (each distinct item
   once) go to the HF processor, in one call on a worker-pool thread, with the model's dummy text.
4. Split the outputs per item (the model's fields) and cache them. With device normalisation on,
   pixels come out raw and travel as uint8.
5. Tokenise the prompt (or take the token ids given) and apply the model's prompt updates,
   recording each item's placeholder range.

With ``hf_prompt_expansion=True`` and a text prompt whose items all miss the cache, step 3 calls
the HF processor on the prompt itself, HF expands the placeholders and mmproc only locates the
ranges; both paths give identical results (a tested promise).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmproc.cache import ProcessorCache
from mmproc.context import ModelContext, read_model_config
from mmproc.errors import (
    ConfigurationError,
    MediaItemError,
    MmprocError,
    ProcessingError,
    PromptUpdateError,
)
from mmproc.executor import (
    ProcessorPool,
    create_io_pool,
    fast_processor_kwargs,
    preprocessing_path,
    requested_worker_count,
    resolve_worker_count,
)
from mmproc.fields import split_outputs
from mmproc.hashing import hash_context, hash_item, item_key
from mmproc.inputs import parse_mm_data
from mmproc.prompt_update import (
    PlaceholderRange,
    PromptReplacement,
    apply_prompt_updates,
    find_placeholder_ranges,
)

if TYPE_CHECKING:
    from mmproc.fused_norm import NormSpec
    from mmproc.model_hooks import ModelHooks
    from mmproc.wire import EngineRequest

__all__ = ["MultiModalFeature", "ProcessedInputs", "Processor", "get_processor", "tokenizer_of"]

logger = logging.getLogger("mmproc.processor")

# Files of a model folder whose content decides the processor's outputs (part of the cache key).
_PROCESSOR_CONFIG_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
# Options that change what the processor outputs for an item (part of the cache key).
_OUTPUT_OPTIONS = ("backend", "hf_processor_kwargs")


@dataclass(frozen=True)
class MultiModalFeature:
    """One media item of a processed request.

    ``data`` holds the item's own tensors (e.g. its pixel patches and grid), ``placeholder``
    where its embeddings go in ``prompt_token_ids``, ``hash`` the content hash (the item, the
    model and the options that shape the outputs). ``norm`` is set when the pixels named by it
    are raw uint8 and the engine must normalise them (:class:`mmproc.fused_norm.FusedInputNorm`).
    Tensors may be shared with the cache: treat them as read-only.
    """

    modality: str
    item_index: int
    hash: str
    data: Mapping[str, Any]
    placeholder: PlaceholderRange
    norm: NormSpec | None = None


@dataclass(frozen=True)
class ProcessedInputs:
    """What an engine core needs for one request."""

    prompt_token_ids: list[int]
    features: list[MultiModalFeature] = field(default_factory=list)

    @property
    def placeholders(self) -> dict[str, list[PlaceholderRange]]:
        """Modality -> placeholder ranges in item order."""
        result: dict[str, list[PlaceholderRange]] = {}
        for feature in sorted(self.features, key=lambda f: (f.modality, f.item_index)):
            result.setdefault(feature.modality, []).append(feature.placeholder)
        return result

    def to_engine_request(
        self, request_id: str, params: Mapping[str, Any] | None = None
    ) -> EngineRequest:
        """This request in the wire schema, ready for :class:`mmproc.wire.RequestSender`."""
        import torch

        from mmproc.wire import EngineRequest, WireFeature

        features = []
        for feature in self.features:
            mask = feature.placeholder.is_embed
            features.append(
                WireFeature(
                    modality=feature.modality,
                    item_index=feature.item_index,
                    hash=feature.hash,
                    offset=feature.placeholder.offset,
                    length=feature.placeholder.length,
                    is_embed=None if mask is None else torch.tensor(mask, dtype=torch.bool),
                    data={k: torch.as_tensor(v) for k, v in feature.data.items()},
                    norm=None if feature.norm is None else feature.norm.to_wire(),
                )
            )
        return EngineRequest(request_id, list(self.prompt_token_ids), features, dict(params or {}))


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer behind an HF processor (some processors are a bare tokenizer)."""
    return getattr(processor, "tokenizer", processor)


@dataclass
class _Request:
    """A request between its preparation and its processing."""

    prompt: str | list[int]
    items: dict[str, list[Any]]
    keys: dict[str, list[str]]
    cached: dict[str, dict[str, Any]]
    hf_kwargs: dict[str, Any]  # what the HF processor gets: the processor's own plus the user's
    user_kwargs: dict[str, Any]

    @property
    def mm_counts(self) -> dict[str, int]:
        return {modality: len(items) for modality, items in self.items.items()}

    def missing(self) -> dict[str, list[tuple[str, Any]]]:
        """Modality -> (key, item) of each distinct item not in the cache."""
        result: dict[str, list[tuple[str, Any]]] = {}
        for modality, items in self.items.items():
            seen: set[str] = set()
            for key, item in zip(self.keys[modality], items):
                if key not in self.cached and key not in seen:
                    seen.add(key)
                    result.setdefault(modality, []).append((key, item))
        return result


class Processor:
    """Preprocesses requests for one model: media, placeholders, cache, worker pool.

    Build it with :func:`get_processor`. Thread-safe: call :meth:`process` from any thread, or
    ``await`` :meth:`process_async` from an event loop. Call :meth:`close` (or use it as a context
    manager) to stop its threads.
    """

    def __init__(self, model: ModelHooks, ctx: ModelContext) -> None:
        self.model = model
        self.ctx = ctx
        options = ctx.options
        warm_up = options.get("warm_up", "background")
        if warm_up not in (True, False, "background"):
            raise ConfigurationError(
                f"warm_up must be True, False or 'background', got {warm_up!r}"
            )
        self.hf_processor = model.load_hf_processor(ctx)
        self.device = options.get("device", "cpu")
        self.path = preprocessing_path(self.hf_processor, device=self.device)
        self.workers = resolve_worker_count(
            requested=requested_worker_count(options.get("workers")),
            hint=model.worker_count_hint(ctx, self.path),
            supports_concurrency=model.supports_concurrency(ctx),
            path=self.path,
            model=f"{ctx.architecture} (plugin {ctx.plugin!r})",
        )
        self._base_kwargs: dict[str, Any] = fast_processor_kwargs(self.hf_processor, self.device)
        # The plugin's spec; it also describes raw pixels cached before a fallback disabled it.
        self._spec = self._resolve_norm_spec(options.get("device_normalize"))
        self._device_normalize = self._spec is not None
        self._hf_prompt_expansion = bool(options.get("hf_prompt_expansion", False))
        self.cache = ProcessorCache(options.get("cache_bytes"))
        self._context_digests: dict[str, bytes] = {}
        self._processor_config = _processor_config(ctx.model_path)
        self._state_lock = threading.Lock()
        self._io_pool = create_io_pool(options.get("io_workers"))
        self._pool = ProcessorPool(lambda: self.hf_processor, self.workers, model=ctx.architecture)
        # The processor is final here (plugins customise it in load_hf_processor), so the clones
        # can be made now: in the background by default, so neither construction nor the first
        # requests pay for them (a Qwen2-sized tokenizer costs ~0.45 s a copy).
        if warm_up:
            self._pool.warm_up(wait=warm_up is True)

    # --- construction helpers ----------------------------------------------------------------

    def _resolve_norm_spec(self, device_normalize: Any) -> NormSpec | None:
        if device_normalize not in (None, True, False):
            raise ConfigurationError(
                f"device_normalize must be True, False or None, got {device_normalize!r}"
            )
        if device_normalize is False:
            return None
        spec = self.model.device_norm_spec(self.ctx, self.hf_processor)
        if spec is None:
            if device_normalize:
                raise ConfigurationError(
                    f"device_normalize=True, but plugin {self.ctx.plugin!r} gives no "
                    f"device normalisation for {self.ctx.architecture}"
                )
            return None
        return spec

    @property
    def norm_spec(self) -> NormSpec | None:
        """The device normalisation new requests get, or None when pixels are normalised here."""
        return self._spec if self._device_normalize else None

    def _hf_kwargs(self, user_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        kwargs = dict(self._base_kwargs)
        if self._device_normalize:
            from mmproc.fused_norm import raw_pixel_kwargs

            kwargs.update(raw_pixel_kwargs())
        kwargs.update(user_kwargs)
        return kwargs

    def _context_digest(self, hf_kwargs: Mapping[str, Any]) -> bytes:
        # Keyed by the kwargs' canonical text: the digest is reused by every request alike.
        text = json.dumps([hf_kwargs, self._device_normalize], sort_keys=True, default=repr)
        digest = self._context_digests.get(text)
        if digest is None:
            import transformers

            options = {name: self.ctx.options.get(name) for name in _OUTPUT_OPTIONS}
            options.update(
                hf_kwargs=dict(hf_kwargs),
                device_normalize=self._device_normalize,
                transformers=transformers.__version__,
            )
            try:
                digest = hash_context(self.ctx.architecture, self._processor_config, options)
            except TypeError as exc:
                raise ConfigurationError(
                    f"hf_kwargs cannot be part of a cache key: {exc}"
                ) from None
            if len(self._context_digests) < 1024:
                self._context_digests[text] = digest
        return digest

    # --- the pipeline ------------------------------------------------------------------------

    def process(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any] | None = None,
        hf_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Preprocess one request: ``prompt`` (text or token ids) and its media."""
        request = self._prepare(prompt, mm_data or {}, hf_kwargs)
        return self._pool.run(self._process_prepared, request)

    async def process_async(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any] | None = None,
        hf_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Like :meth:`process`, without blocking the event loop on loading or preprocessing."""
        loop = asyncio.get_running_loop()
        request = await loop.run_in_executor(
            self._io_pool, self._prepare, prompt, mm_data or {}, hf_kwargs
        )
        return await self._pool.run_async(self._process_prepared, request)

    def _prepare(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any],
        hf_kwargs: Mapping[str, Any] | None,
    ) -> _Request:
        prompt = _check_prompt(prompt)
        user_kwargs = dict(hf_kwargs or {})
        kwargs = self._hf_kwargs(user_kwargs)
        items = parse_mm_data(mm_data, io_pool=self._io_pool)
        digest = self._context_digest(hf_kwargs or {})
        keys = {
            modality: [item_key(digest, hash_item(modality, item)) for item in modality_items]
            for modality, modality_items in items.items()
        }
        all_keys = [key for modality_keys in keys.values() for key in modality_keys]
        cached = {
            key: entry
            for key, entry in zip(all_keys, self.cache.lookup(all_keys))
            if entry is not None
        }
        return _Request(prompt, items, keys, cached, kwargs, user_kwargs)

    def _process_prepared(self, request: _Request, *, processor: Any) -> ProcessedInputs:
        """Runs on a worker thread with that thread's processor clone."""
        ctx, model = self.ctx, self.model
        tokenizer = tokenizer_of(processor)
        entries = dict(request.cached)
        missing = request.missing()
        expanded_ids: list[int] | None = None
        if missing:
            missing_items = {m: [item for _, item in pairs] for m, pairs in missing.items()}
            counts = {m: len(v) for m, v in missing_items.items()}
            use_prompt = (
                self._hf_prompt_expansion
                and isinstance(request.prompt, str)
                and not request.cached
                and counts == request.mm_counts
            )
            text = request.prompt if use_prompt else model.get_dummy_text(ctx, counts)
            try:
                outputs = model.process_mm_data(
                    ctx, text, missing_items, processor, request.hf_kwargs
                )
            except ProcessingError as exc:
                raise self._explain_failure(exc, request, missing, processor) from exc
            per_item = split_outputs(outputs, model.get_mm_fields(ctx, outputs), counts)
            cacheable = True
            if request.hf_kwargs.get("do_normalize") is False and self._spec is not None:
                if not self._make_raw_uint8(per_item):
                    # Rerun on the float path: these pixels are neither raw nor trustworthy.
                    kwargs = {**self._base_kwargs, **request.user_kwargs}
                    outputs = model.process_mm_data(ctx, text, missing_items, processor, kwargs)
                    per_item = split_outputs(outputs, model.get_mm_fields(ctx, outputs), counts)
                    cacheable = False  # their keys say "raw": never serve floats under them
            if use_prompt and "input_ids" in outputs:
                expanded_ids = _first_row(outputs["input_ids"])
            new_entries = {
                key: entry
                for modality, pairs in missing.items()
                for (key, _), entry in zip(pairs, per_item.get(modality, []))
            }
            entries.update(new_entries)
            if cacheable:
                self.cache.insert(new_entries, protect=list(entries))

        item_outputs = {
            modality: [entries[key] for key in request.keys[modality]] for modality in request.items
        }
        updates = model.get_prompt_updates(ctx, processor, request.items, item_outputs)
        counts = request.mm_counts
        if expanded_ids is not None:
            prompt_ids = expanded_ids
            placeholders = find_placeholder_ranges(prompt_ids, updates, counts, tokenizer)
        else:
            if isinstance(request.prompt, str):
                ids = list(tokenizer(request.prompt)["input_ids"])
            else:
                ids = request.prompt
            _check_placeholder_count(ids, updates, counts, tokenizer)
            new_prompt, placeholders = apply_prompt_updates(ids, updates, counts, tokenizer)
            prompt_ids = list(new_prompt)
        features = [
            MultiModalFeature(
                modality=modality,
                item_index=index,
                hash=request.keys[modality][index],
                data=item_outputs[modality][index],
                placeholder=ranges[index],
                norm=self._norm_of(item_outputs[modality][index]),
            )
            for modality, ranges in placeholders.items()
            for index in range(len(ranges))
        ]
        features.sort(key=lambda f: f.placeholder.offset)
        return ProcessedInputs(prompt_ids, features)

    def _explain_failure(
        self,
        error: ProcessingError,
        request: _Request,
        missing: dict[str, list[tuple[str, Any]]],
        processor: Any,
    ) -> MmprocError:
        """Name the request item a processor failure comes from, when one item is the cause.

        Each item is retried alone: if some fail and others pass, the first failing one is the
        culprit (a :class:`MediaItemError` with its index in the request); if all fail, the
        request's settings are (the original error, items named).
        """
        pairs = [(m, key, item) for m, entries in missing.items() for key, item in entries]
        failing: list[tuple[str, str, BaseException]] = []
        if len(pairs) > 1:
            for modality, key, item in pairs:
                try:
                    self.model.process_mm_data(
                        self.ctx,
                        self.model.get_dummy_text(self.ctx, {modality: 1}),
                        {modality: [item]},
                        processor,
                        request.hf_kwargs,
                    )
                except ProcessingError as exc:
                    failing.append((modality, key, exc.__cause__ or exc))
        if failing and len(failing) < len(pairs):
            modality, key, cause = failing[0]
            index = request.keys[modality].index(key)
            return MediaItemError(
                modality,
                index,
                f"the {self.ctx.architecture} processor (plugin {self.ctx.plugin!r}) rejects it: "
                f"{type(cause).__name__}: {cause}",
            )
        if len(pairs) == 1:
            modality, key, _ = pairs[0]
            index = request.keys[modality].index(key)
            return ProcessingError(f"{modality} item {index}: {error}")
        return error

    def _make_raw_uint8(self, per_item: dict[str, list[dict[str, Any]]]) -> bool:
        """Turn raw pixel outputs into uint8 in place; False (and device normalisation switched
        off, with a warning) when some are not whole numbers in [0, 255]."""
        from mmproc.fused_norm import to_uint8_pixels

        spec = self._spec
        assert spec is not None
        for modality, entries in per_item.items():
            for index, entry in enumerate(entries):
                for key in spec.pixel_keys:
                    if key not in entry:
                        continue
                    raw = to_uint8_pixels(entry[key])
                    if raw is None:
                        self._disable_device_normalisation(modality, index, key)
                        return False
                    entry[key] = raw
        return True

    def _disable_device_normalisation(self, modality: str, index: int, key: str) -> None:
        with self._state_lock:
            if not self._device_normalize:
                return
            self._device_normalize = False
        logger.warning(
            "%s (plugin %r): with rescale and normalise off, %r of %s item %d is not raw "
            "pixels (whole numbers in [0, 255]); device normalisation is now off for this "
            "processor and pixels are normalised on the CPU (float path)",
            self.ctx.architecture,
            self.ctx.plugin,
            key,
            modality,
            index,
        )

    def _norm_of(self, entry: Mapping[str, Any]) -> NormSpec | None:
        """The spec the engine must apply: set when the entry's pixels are raw (uint8)."""
        spec = self._spec
        if spec is None:
            return None
        raw = any(
            getattr(entry[key], "dtype", None) is not None
            and str(entry[key].dtype).endswith("uint8")
            for key in spec.pixel_keys
            if key in entry
        )
        return spec if raw else None

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def pool(self) -> ProcessorPool:
        """The worker pool running this processor's HF calls."""
        return self._pool

    def warm_up(self) -> None:
        """Make every worker's processor clone now, so the first requests do not pay for it."""
        self._pool.warm_up()

    def close(self) -> None:
        """Stop the worker and IO threads (waits for running requests)."""
        self._pool.shutdown()
        self._io_pool.shutdown()

    def __enter__(self) -> Processor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Processor({self.ctx.architecture!r}, plugin={self.ctx.plugin!r}, "
            f"path={self.path}, workers={self.workers}, "
            f"device_normalize={self.norm_spec is not None})"
        )


def _first_row(ids: Any) -> list[int]:
    rows = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return list(rows[0]) if rows and isinstance(rows[0], list) else list(rows)


def _check_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return list(prompt)
    raise PromptUpdateError("the prompt must be a string or a sequence of non-negative token ids")


def _check_placeholder_count(
    ids: list[int], updates: Sequence[Any], counts: Mapping[str, int], tokenizer: Any
) -> None:
    """A prompt with more placeholders than items is an error, not silently left unexpanded."""
    for modality, count in counts.items():
        targets = {
            _target_ids(u.target, tokenizer)
            for u in updates
            if isinstance(u, PromptReplacement) and u.modality == modality
        }
        targets.discard(None)
        if len(targets) != 1:
            continue  # several alternative targets: the apply step checks each item
        (target,) = targets
        assert target is not None
        found = _count_occurrences(ids, target)
        if found > count:
            raise PromptUpdateError(
                f"the prompt has {found} {modality} placeholders but the request has "
                f"{count} {modality} item{'s' if count != 1 else ''}",
                modality=modality,
            )


def _target_ids(target: Any, tokenizer: Any) -> tuple[int, ...] | None:
    if isinstance(target, str):
        return tuple(tokenizer.encode(target, add_special_tokens=False))
    if isinstance(target, tuple) and all(isinstance(t, int) for t in target):
        return target
    return None  # zero-width index targets


def _count_occurrences(ids: list[int], target: tuple[int, ...]) -> int:
    if not target:
        return 0
    if len(target) == 1:
        return ids.count(target[0])
    found, i, n = 0, 0, len(target)
    first = target[0]
    while True:
        try:
            i = ids.index(first, i)
        except ValueError:
            return found
        if tuple(ids[i : i + n]) == target:
            found += 1
            i += n
        else:
            i += 1


def _processor_config(folder: Path | None) -> dict[str, str]:
    if folder is None:
        return {}
    config = {}
    for name in _PROCESSOR_CONFIG_FILES:
        path = folder / name
        if path.is_file():
            config[name] = path.read_text(encoding="utf-8")
    return config


def get_processor(name_or_folder: str | os.PathLike[str], **options: Any) -> Processor:
    """The :class:`Processor` for an architecture name or a local model folder.

    ``name_or_folder`` is a folder holding ``config.json`` (looked up by its ``architectures``)
    or an architecture name (then pass ``model_path=`` for models that load files). Options:

    ``workers``
        preprocessing threads (default: 2 on the CPU path, 1 on the device path; env
        ``MMPROC_WORKERS``).
    ``io_workers``
        media-loading threads (default 4; env ``MMPROC_IO_WORKERS``).
    ``device``
        where a fast (torchvision) image processor runs (default ``"cpu"``).
    ``backend``
        image backend, ``"pil"`` or ``"torchvision"``, for plugins that offer both.
    ``device_normalize``
        ship raw uint8 pixels for the engine to normalise (default: on when the plugin supports
        it; ``True`` insists, ``False`` normalises on the CPU).
    ``cache_bytes``
        processor-output cache size (default 4 GiB or env ``MMPROC_CACHE_BYTES``; 0 disables).
    ``hf_prompt_expansion``
        let the HF processor expand the placeholders of a text prompt when no item is cached.
    ``warm_up``
        when to make the workers' processor clones: ``"background"`` (default: right away,
        without blocking), ``True`` (before returning), ``False`` (on each worker's first task).
    ``prefer``
        ``{architecture: plugin}`` when several plugins claim the architecture.
    ``hf_processor_kwargs``
        extra keyword arguments for the HF processor's ``from_pretrained``.
    ``registry``
        the :class:`mmproc.registry.Registry` to look the model up in (default: the process's).

    Plugins may read further options of their own from ``ctx.options``.
    """
    from mmproc.registry import get_registry

    options = dict(options)
    prefer = options.pop("prefer", None)
    model_path = options.pop("model_path", None)
    registry = options.pop("registry", None) or get_registry()
    target = os.fspath(name_or_folder)
    if os.path.isdir(target):
        folder = Path(target)
        reference = registry.resolve_folder(folder, prefer=prefer)
        config = read_model_config(folder)
    else:
        folder = Path(model_path) if model_path is not None else None
        reference = registry.resolve(target, prefer=prefer)
        config = read_model_config(folder) if folder is not None else {}
    model = registry.load_model(reference)
    ctx = ModelContext(
        architecture=reference.architecture,
        model_path=folder,
        config=config,
        options=options,
        plugin=reference.plugin,
    )
    return Processor(model, ctx)
