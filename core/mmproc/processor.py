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
import difflib
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmproc.cache import ProcessorCache, compact_entry
from mmproc.context import ModelContext, read_model_config
from mmproc.errors import (
    ConfigurationError,
    FieldSpecError,
    MediaItemError,
    MmprocError,
    ProcessingError,
    ProcessorLoadError,
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
from mmproc.hashing import (
    DEFAULT_HASH_ALGORITHM,
    canonical_json,
    check_hash_algorithm,
    hash_context,
    hash_item,
    item_key,
)
from mmproc.inflight import InFlight
from mmproc.inputs import MODALITIES, parse_mm_data
from mmproc.placeholder_checks import (
    check_placeholder_count,
    check_prompt,
    check_unused_placeholders,
)
from mmproc.processed import MultiModalFeature, ProcessedInputs
from mmproc.prompt_update import (
    apply_prompt_updates,
    find_placeholder_ranges,
)

if TYPE_CHECKING:
    from mmproc.fused_norm import NormSpec
    from mmproc.model_hooks import ModelHooks

__all__ = ["MultiModalFeature", "ProcessedInputs", "Processor", "get_processor", "tokenizer_of"]

# The results live in their own module; they are re-exported here, where users meet them.

logger = logging.getLogger("mmproc.processor")

# Files of a model folder whose content decides the processor's outputs (part of the cache key).
_PROCESSOR_CONFIG_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
# The options the core reads (`get_processor` documents each); a plugin names its own through the
# extra_options hook, and anything else is refused as a likely misspelling.
CORE_OPTIONS = frozenset(
    {
        "workers",
        "io_workers",
        "device",
        "device_normalize",
        "cache_bytes",
        "hf_prompt_expansion",
        "warm_up",
        "hf_processor_kwargs",
        "hash_algorithm",
    }
)
# Read by get_processor itself, never passed on to the Processor.
_LOOKUP_OPTIONS = frozenset({"prefer", "model_path", "registry"})
# Options that cannot change what the processor outputs for an item; every other option (plugins
# may read their own) is part of the cache key and of each item's hash. (The hash algorithm needs
# no place there: it decides the function every key is made with.)
_NON_OUTPUT_OPTIONS = frozenset(
    {
        "workers",
        "io_workers",
        "cache_bytes",
        "warm_up",
        "hf_prompt_expansion",
        "device_normalize",
        "hash_algorithm",
    }
)
# hf_kwargs a user may pass that decide whether pixels come out raw.
_RAW_PIXEL_KEYS = frozenset({"do_rescale", "do_normalize"})


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
    raw: bool  # pixels come out raw (rescale and normalise off) for device normalisation
    owned: dict[str, Any] = field(default_factory=dict)  # its claims (mmproc.inflight)

    @property
    def mm_counts(self) -> dict[str, int]:
        return {modality: len(items) for modality, items in self.items.items()}

    def misses(self) -> list[str]:
        """The keys of the items not in the cache, repeats kept (cache statistics count them)."""
        return [key for keys in self.keys.values() for key in keys if key not in self.cached]

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
        self._check_option_names(model, ctx)
        warm_up = options.get("warm_up", "background")
        if warm_up not in (True, False, "background"):
            raise ConfigurationError(
                f"warm_up must be True, False or 'background', got {warm_up!r}"
            )
        try:
            self.hash_algorithm = check_hash_algorithm(
                options.get("hash_algorithm", DEFAULT_HASH_ALGORITHM)
            )
        except ValueError as exc:
            raise ConfigurationError(f"hash_algorithm: {exc}") from None
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
        self._in_flight = InFlight()
        self._thread_state = threading.local()  # .processing: inside this processor's worker call
        self._state_lock = threading.Lock()
        self._placeholder_ids_cache: dict[str, list[int]] | None = None
        self._context_digest({}, self._device_normalize)  # options unfit for a cache key fail here
        self._io_pool = create_io_pool(options.get("io_workers"))
        # Async requests are prepared (parsed, hashed, looked up) here, off the event loop; its
        # threads mostly wait for the IO pool, so the same count of them is plenty.
        self._prepare_pool = create_io_pool(options.get("io_workers"), name="mmproc-prepare")
        # The processor is final here (plugins customise it in load_hf_processor), so the clones
        # can be made now: in the background by default, so neither construction nor the first
        # requests pay for them (a Qwen2-sized tokenizer costs ~0.45 s a copy).
        self._pool = ProcessorPool(
            lambda: self.hf_processor, self.workers, warm_up=warm_up, model=ctx.architecture
        )

    # --- construction helpers ----------------------------------------------------------------

    @staticmethod
    def _check_option_names(model: ModelHooks, ctx: ModelContext) -> None:
        """Refuse options nobody reads: a misspelled ``worker=2`` must not silently do nothing."""
        known = CORE_OPTIONS | model.extra_options(ctx)
        unknown = sorted(set(ctx.options) - known)
        if not unknown:
            return
        vocabulary = sorted(known | _LOOKUP_OPTIONS)
        described = []
        for name in unknown:
            close = difflib.get_close_matches(name, vocabulary, n=1)
            described.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
        raise ConfigurationError(
            f"unknown processor option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(described)} for {ctx.architecture} (plugin {ctx.plugin!r}); "
            f"known options: {', '.join(vocabulary)}"
        )

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

    def _raw_pixels_for(self, user_kwargs: Mapping[str, Any]) -> bool:
        """Whether a request's pixels come out raw: device normalisation is on and the user's
        ``hf_kwargs`` do not set rescale or normalise themselves."""
        return self._device_normalize and not (set(user_kwargs) & _RAW_PIXEL_KEYS)

    def _hf_kwargs(self, user_kwargs: Mapping[str, Any], raw: bool) -> dict[str, Any]:
        kwargs = dict(self._base_kwargs)
        if raw:
            from mmproc.fused_norm import raw_pixel_kwargs

            kwargs.update(raw_pixel_kwargs())
        kwargs.update(user_kwargs)
        return kwargs

    def _context_digest(self, hf_kwargs: Mapping[str, Any], raw: bool) -> bytes:
        """The part of every cache key that is not the item: model, configuration, options."""
        try:
            # The canonical text is the memo key: two kwargs with one text hash alike anyway.
            text = canonical_json([hf_kwargs, raw])
        except TypeError as exc:
            raise ConfigurationError(f"hf_kwargs cannot be part of a cache key: {exc}") from None
        digest = self._context_digests.get(text)
        if digest is None:
            import transformers

            options = {
                name: value
                for name, value in self.ctx.options.items()
                if name not in _NON_OUTPUT_OPTIONS
            }
            options.update(
                hf_kwargs=dict(hf_kwargs),
                raw_pixels=raw,
                plugin=self.ctx.plugin,
                transformers=transformers.__version__,
            )
            try:
                digest = hash_context(
                    self.ctx.architecture, self._processor_config, options, self.hash_algorithm
                )
            except TypeError as exc:
                raise ConfigurationError(f"options cannot be part of a cache key: {exc}") from None
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
        if not getattr(self._thread_state, "processing", False):
            # Items other requests are computing right now. (Not from inside a worker's call: it
            # could be waiting for its own claim.)
            self._in_flight.wait(request.misses())
        return self._pool.run(self._process_prepared, request)

    async def process_async(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any] | None = None,
        hf_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Like :meth:`process`, without blocking the event loop on loading or preprocessing."""
        loop = asyncio.get_running_loop()
        # Not on the IO pool itself: preparing waits for decode jobs it puts on that pool, and
        # waiting inside the pool for the pool deadlocks once every IO thread does it.
        request = await loop.run_in_executor(
            self._prepare_pool, self._prepare, prompt, mm_data or {}, hf_kwargs
        )
        # Waiting for items other requests compute holds no thread: the prepare pool stays free
        # for the requests behind this one.
        await self._in_flight.wait_async(request.misses())
        return await self._pool.run_async(self._process_prepared, request)

    def _prepare(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any],
        hf_kwargs: Mapping[str, Any] | None,
    ) -> _Request:
        prompt = check_prompt(prompt)
        user_kwargs = dict(hf_kwargs or {})
        raw = self._raw_pixels_for(user_kwargs)
        digest = self._context_digest(user_kwargs, raw)
        items = parse_mm_data(mm_data, io_pool=self._io_pool)
        algorithm = self.hash_algorithm
        keys = {
            modality: [
                item_key(digest, hash_item(modality, item, algorithm), algorithm)
                for item in modality_items
            ]
            for modality, modality_items in items.items()
        }
        all_keys = [key for modality_keys in keys.values() for key in modality_keys]
        cached = self._lookup(all_keys)
        return _Request(
            prompt, items, keys, cached, self._hf_kwargs(user_kwargs, raw), user_kwargs, raw
        )

    def _lookup(self, keys: list[str], *, retry: bool = False) -> dict[str, dict[str, Any]]:
        """The cache entries of those ``keys`` that hit (``retry``: see `ProcessorCache.lookup`)."""
        found = self.cache.lookup(keys, retry=retry)
        return {key: entry for key, entry in zip(keys, found) if entry is not None}

    def _process_prepared(self, request: _Request, *, processor: Any) -> ProcessedInputs:
        """Runs on a worker thread with that thread's processor clone."""
        if self.cache.enabled and (misses := request.misses()):
            # Whatever other requests finished since this one was prepared (or while it waited
            # for them) is a hit now; the rest is claimed, so that requests arriving from here on
            # wait for it instead of computing it too.
            request.cached.update(self._lookup(misses, retry=True))
            request.owned = self._in_flight.claim(k for k in misses if k not in request.cached)
        state = self._thread_state
        nested = getattr(state, "processing", False)
        state.processing = True
        try:
            return self._process_claimed(request, processor)
        finally:
            state.processing = nested
            self._in_flight.release(request.owned)  # also when processing failed

    def _process_claimed(self, request: _Request, processor: Any) -> ProcessedInputs:
        ctx, model = self.ctx, self.model
        tokenizer = tokenizer_of(processor)
        entries = dict(request.cached)
        missing = request.missing()
        expanded_ids: list[int] | None = None
        if missing:
            new_entries, expanded_ids = self._process_missing(request, missing, processor)
            entries.update(new_entries)

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
            check_unused_placeholders(ids, self._placeholder_ids(tokenizer), counts)
            check_placeholder_count(ids, updates, counts, tokenizer)
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

    def _process_missing(
        self, request: _Request, missing: dict[str, list[tuple[str, Any]]], processor: Any
    ) -> tuple[dict[str, dict[str, Any]], list[int] | None]:
        """Run the HF processor on the items not in the cache; cache and return their outputs.

        Returns the per-item outputs by key, and the prompt ids when HF expanded the prompt.
        """
        ctx, model = self.ctx, self.model
        items = {m: [item for _, item in pairs] for m, pairs in missing.items()}
        counts = {m: len(v) for m, v in items.items()}
        dummy = model.get_dummy_text(ctx, counts)
        use_prompt = (
            self._hf_prompt_expansion
            and isinstance(request.prompt, str)
            and not request.cached
            and counts == request.mm_counts
        )
        kwargs = request.hf_kwargs
        outputs = None
        if use_prompt:
            try:
                outputs = model.process_mm_data(ctx, request.prompt, items, processor, kwargs)
            except ProcessingError:
                # Most often the prompt and the items disagree: the dummy-text path below says
                # so precisely (PromptUpdateError), or finds the item at fault.
                use_prompt = False
        if outputs is None:
            try:
                outputs = model.process_mm_data(ctx, dummy, items, processor, kwargs)
            except ProcessingError as exc:
                raise self._locate_failure(exc, request, missing, processor) from exc
        per_item = self._split(outputs, counts)
        cacheable = True
        if request.raw and not self._make_raw_uint8(per_item):
            # Neither raw nor trustworthy: rerun these items on the float path.
            kwargs = {**self._base_kwargs, **request.user_kwargs}
            text = request.prompt if use_prompt else dummy
            outputs = model.process_mm_data(ctx, text, items, processor, kwargs)
            per_item = self._split(outputs, counts)
            cacheable = False  # their keys say "raw": never serve floats under them
        expanded_ids = (
            _first_row(outputs["input_ids"]) if use_prompt and "input_ids" in outputs else None
        )
        new_entries = {
            key: entry
            for modality, pairs in missing.items()
            for (key, _), entry in zip(pairs, per_item.get(modality, []))
        }
        if cacheable and self.cache.enabled:
            # One compact copy per item, shared by the cache and this request's features, so the
            # batch tensor is freed with the request rather than held by views.
            new_entries = {key: compact_entry(entry) for key, entry in new_entries.items()}
            self.cache.insert(new_entries, protect=[*request.cached, *new_entries])
            # The results are in the cache (or refused by it): waiters need not wait for the rest
            # of this request. Released claims leave `owned`, so they cannot be released twice.
            done = {key: request.owned.pop(key) for key in new_entries if key in request.owned}
            self._in_flight.release(done)
        return new_entries, expanded_ids

    def _split(self, outputs: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, Any]:
        try:
            return split_outputs(outputs, self.model.get_mm_fields(self.ctx, outputs), counts)
        except FieldSpecError as exc:
            raise FieldSpecError(
                f"{self.ctx.architecture} (plugin {self.ctx.plugin!r}): {exc}"
            ) from exc

    def _placeholder_ids(self, tokenizer: Any) -> dict[str, list[int]]:
        """Modality -> token ids of the model's placeholder for one item (computed once)."""
        cached = self._placeholder_ids_cache
        if cached is None:
            cached = {}
            for modality in MODALITIES:
                try:
                    text = self.model.get_dummy_text(self.ctx, {modality: 1})
                except Exception:
                    continue  # a model may refuse (or say nothing for) a modality it lacks
                if text:
                    cached[modality] = list(tokenizer.encode(text, add_special_tokens=False))
            self._placeholder_ids_cache = cached
        return cached

    def _locate_failure(
        self,
        error: ProcessingError,
        request: _Request,
        missing: dict[str, list[tuple[str, Any]]],
        processor: Any,
    ) -> MmprocError:
        """Name the request item a processor failure comes from.

        Halving the batch finds the first failing item in about the work of one more batch. When
        some items pass, the settings are fine and that item is the culprit: a
        :class:`MediaItemError` with its index in the request. When every part fails, the
        settings are at fault and the original error stands. A lone item is named as it is.
        """
        pairs = [(m, key, item) for m, entries in missing.items() for key, item in entries]

        def run(part: list[tuple[str, str, Any]]) -> BaseException | None:
            items: dict[str, list[Any]] = {}
            for modality, _, item in part:
                items.setdefault(modality, []).append(item)
            text = self.model.get_dummy_text(self.ctx, {m: len(v) for m, v in items.items()})
            try:
                self.model.process_mm_data(self.ctx, text, items, processor, request.hf_kwargs)
            except ProcessingError as exc:
                return exc.__cause__ or exc
            return None

        part, cause, saw_pass = pairs, error.__cause__ or error, False
        while len(part) > 1:
            half = part[: len(part) // 2]
            failure = run(half)
            if failure is None:
                saw_pass, part = True, part[len(part) // 2 :]
            else:
                cause, part = failure, half
        if len(pairs) > 1:
            confirmed = run([part[0]])
            if confirmed is None:
                return error  # no single item fails alone: the items only fail together
            cause = confirmed
        if len(pairs) > 1 and not saw_pass:
            saw_pass = run([p for p in pairs if p is not part[0]]) is None
            if not saw_pass:
                return error  # every part fails: the settings, not an item
        modality, key, _ = part[0]
        return MediaItemError(
            modality,
            request.keys[modality].index(key),
            f"the {self.ctx.architecture} processor (plugin {self.ctx.plugin!r}) rejects it: "
            f"{type(cause).__name__}: {cause}",
        )

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
        self._prepare_pool.shutdown()
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
        image backend, ``"pil"`` or ``"torchvision"``, for plugins that offer both (and say so in
        their ``extra_options`` hook; for other models it is an unknown option).
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
    ``hash_algorithm``
        ``"blake3"`` (default, cryptographic) or ``"xxh3"`` (faster; for trusted clients only),
        for item hashes and cache keys (see :mod:`mmproc.hashing`).
    ``prefer``
        ``{architecture: plugin}`` when several plugins claim the architecture.
    ``hf_processor_kwargs``
        extra keyword arguments for the HF processor's ``from_pretrained``.
    ``registry``
        the :class:`mmproc.registry.Registry` to look the model up in (default: the process's).

    Plugins may read further options of their own from ``ctx.options``, once they name them in
    their ``extra_options`` hook; any option neither the core nor the plugin reads is a
    `ConfigurationError` naming it (with a "did you mean").
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
        if os.sep in target or target.startswith((".", "~")):
            # Architecture names never hold a path separator: this was meant as a folder.
            raise ProcessorLoadError(f"model folder {target} does not exist")
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
