"""The request pipeline: ``(prompt, media) -> ProcessedInputs``.

For each request (:meth:`Processor.process`, :meth:`Processor.process_async`), the steps of
:meth:`Processor._route`, in order:

1. Read the media items (:mod:`mmproc.inputs`), on the IO pool when there are several: the
   bytes of those given encoded, nothing parsed yet; check those given decoded, and load them
   unless the caller named them by an id (images, arrays, waveforms).
2. Key each item (:mod:`mmproc.cache_keys`): the caller's id for it, the hash of its bytes (an
   item given encoded: a file, bytes, a URL) or its content hash, combined with the model, its
   processor configuration and the options that change outputs.
3. Look the keys up in the processor-output cache. A cached item holds its outputs and its
   resolved prompt update, so when every item hits, the request is answered right here (steps
   5-6 on the caller's thread): no decoding, no worker, no HF processor. Otherwise the misses
   given encoded are parsed and decoded — unless another request is computing one of them right
   now: then the request waits for it first (:mod:`mmproc.inflight`), looks its misses up again,
   and decodes what the cache still lacks.
4. On a worker-pool thread with that thread's processor clone: run the HF processor on the
   missing items only (each distinct item once), in one call with the model's dummy text (one
   item at a time when they fail together but each passes alone); split the outputs per item
   (the model's fields), resolve each item's prompt update, and cache both. With device
   normalisation on, pixels come out raw and travel as uint8.
5. Tokenise the prompt (or take the token ids given) and apply every item's prompt update,
   recording each item's placeholder range.
6. One feature per item, in prompt order.

``process`` drives the steps on the calling thread, ``process_async`` from the event loop (the
work of steps 1-3 on a prepare pool, the waits on the loop): one sequence, two drivers.

With ``hf_prompt_expansion=True`` and a text prompt whose items all miss the cache, step 4 calls
the HF processor on the prompt itself, HF expands the placeholders and mmproc only locates the
ranges; both paths give identical results (a tested promise).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmproc.cache import CachedItem, ProcessorCache
from mmproc.cache_keys import CacheKeys, check_mm_uuids
from mmproc.chat import ChatOptions, ChatRenderer, RenderedChat
from mmproc.context import ModelContext, ProcessingMode
from mmproc.device_normalization import DeviceNormalization
from mmproc.errors import (
    ChatRequestError,
    MediaItemError,
    ProcessingError,
    PromptUpdateError,
    WorkerProcessError,
)
from mmproc.executor import ProcessorPool, create_io_pool
from mmproc.hf_calls import HFCalls
from mmproc.inflight import InFlight
from mmproc.inputs import ReadMediaItems, read_mm_data
from mmproc.media.items import MODALITIES
from mmproc.media.policy import MediaOptions
from mmproc.placeholder_checks import (
    check_placeholder_count,
    check_prompt,
    check_unused_placeholders,
)
from mmproc.processed import MultiModalFeature, ProcessedInputs
from mmproc.prompt_update import (
    apply_resolved_updates,
    find_resolved_ranges,
    resolve_prompt_updates,
)
from mmproc.stages import NO_CLOCK, StageClock, StageLog
from mmproc.tokenizer_clones import TokenizerClones
from mmproc.worker_count import (
    IO_WORKERS_ENV,
    fast_processor_kwargs,
    preprocessing_path,
    requested_worker_count,
    resolve_io_worker_count,
    resolve_worker_count,
)

if TYPE_CHECKING:
    from mmproc.model_hooks import ModelHooks
    from mmproc.norm_spec import NormSpec
    from mmproc.process_workers import WorkerProcesses, WorkerSpec

__all__ = ["MultiModalFeature", "ProcessedInputs", "Processor", "tokenizer_of"]

# The results live in their own module; they are re-exported here, where users meet them.


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer behind an HF processor (some processors are a bare tokenizer)."""
    return getattr(processor, "tokenizer", processor)


_UNDECODED: Any = object()  # an item given encoded, or named by an id, not decoded (yet)


@dataclass(slots=True)
class _Item:
    """One media item of a request, keyed."""

    modality: str
    index: int
    key: str  # its cache key
    hash: str  # what its feature's hash says
    value: Any = _UNDECODED  # the item itself, once decoded (or given decoded)
    given: bool = True  # whether it came with its data (None: named by its id alone)


@dataclass
class _Request:
    """A request between its preparation and its processing: its items, and which the cache
    holds (``cached``); every other item is a miss."""

    prompt: str | list[int]
    items: list[_Item]  # in the order of MODALITIES, then index
    cached: dict[str, CachedItem]  # the hits, by key
    user_kwargs: dict[str, Any]
    raw: bool  # pixels come out raw (rescale and normalise off) for device normalisation
    owned: dict[str, Any] = field(default_factory=dict)  # its claims (mmproc.inflight)
    clock: StageClock = NO_CLOCK  # where its time goes, when stages are being recorded
    # Its media while the items others compute wait undecoded: the bytes alone (whatever was
    # opened was decoded and closed), so a request abandoned while waiting leaks nothing.
    media: ReadMediaItems | None = None

    @property
    def mm_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for item in self.items:
            counts[item.modality] = counts.get(item.modality, 0) + 1
        return counts

    def misses(self) -> list[_Item]:
        """The items the cache does not hold, repeats kept (cache statistics count them)."""
        return [item for item in self.items if item.key not in self.cached]

    def miss_keys(self) -> list[str]:
        return [item.key for item in self.misses()]

    def to_compute(self) -> list[_Item]:
        """One item of each distinct key the cache does not hold, the first that came with its
        data (an id given twice may come with its data only the second time): what the HF
        processor gets."""
        chosen: dict[str, _Item] = {}
        for item in self.misses():
            current = chosen.get(item.key)
            if current is None or (item.given and not current.given):
                chosen[item.key] = item
        return list(chosen.values())

    def keys_of(self, modality: str) -> list[str]:
        return [item.key for item in self.items if item.modality == modality]


@dataclass(frozen=True, slots=True)
class _OffLoop:
    """A step of work on the calling thread (sync) or the prepare pool (async)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _WaitFor:
    """A step that waits until no other request is computing ``keys``; gives whether it
    waited."""

    keys: list[str]


@dataclass(frozen=True, slots=True)
class _OnWorker:
    """A step on a worker-pool thread, with that thread's processor clone."""

    fn: Callable[..., ProcessedInputs]
    request: _Request


_Route = Generator[_OffLoop | _WaitFor | _OnWorker, Any, ProcessedInputs]
"""A request's steps (:meth:`Processor._route`)."""


@dataclass(frozen=True, slots=True)
class _Done:
    result: ProcessedInputs


def _resume(route: _Route, outcome: Any) -> _OffLoop | _WaitFor | _OnWorker | _Done:
    """Give a step's result (or its exception) back to ``route``: its next step, or its end.
    An exception the route does not handle is raised from here."""
    try:
        if isinstance(outcome, Exception):
            return route.throw(outcome)
        return route.send(outcome)
    except StopIteration as done:
        return _Done(done.value)


class Processor:
    """Preprocesses requests for one model: media, placeholders, cache, worker pool.

    Build it with :func:`mmproc.get_processor`. Thread-safe: call :meth:`process` from any
    thread, or ``await`` :meth:`process_async` from an event loop. Call :meth:`close` (or use it
    as a context manager) to stop its threads.
    """

    def __init__(
        self, model: ModelHooks, ctx: ModelContext, *, worker_spec: WorkerSpec | None = None
    ) -> None:
        self.model = model
        self.ctx = ctx
        options = ctx.processor_options
        self.hf_processor = model.load_hf_processor(ctx)
        self.device = options.device
        self.path = preprocessing_path(self.hf_processor, device=self.device)
        self.workers = resolve_worker_count(
            requested=requested_worker_count(options.workers),
            hint=model.worker_count_hint(ctx, self.path),
            supports_concurrency=model.supports_concurrency(ctx),
            path=self.path,
            model=ctx.model_name,
        )
        self._base_kwargs = fast_processor_kwargs(self.hf_processor, self.device)
        self.normalization = DeviceNormalization.for_model(
            model, ctx, self.hf_processor, options.device_normalize
        )
        self._media = options.media_options(model.media_format(ctx, self.hf_processor))
        self.cache = ProcessorCache(options.cache_bytes)
        self._keys = CacheKeys(ctx, options.hash_algorithm, self._media)
        self._keys.context_digest({}, self.normalization.active)  # unkeyable options fail here
        self._tokenizer = tokenizer_of(self.hf_processor)
        self._placeholder_ids = self._learn_placeholders()
        self._chat = ChatRenderer(
            self.hf_processor,
            self._tokenizer,
            {m: model.get_placeholder_text(ctx, m) for m in self._placeholder_ids},
            model=ctx.model_name,
            max_items=options.max_items_per_request,
            max_chars=options.max_prompt_chars,
        )
        self._in_flight = InFlight()
        self._stage_log: StageLog | None = None
        self._thread_state = threading.local()  # .processing: inside this processor's worker call
        io_workers = resolve_io_worker_count(
            requested=requested_worker_count(options.io_workers, env=IO_WORKERS_ENV)
        )
        self._io_pool = create_io_pool(io_workers)
        # Async requests are prepared (parsed, hashed, looked up) here, off the event loop; its
        # threads mostly wait for the IO pool, so the same count of them is plenty.
        self._prepare_pool = create_io_pool(io_workers, name="mmproc-prepare")
        # The processor is final here (plugins customise it in load_hf_processor), so the clones
        # can be made now: in the background by default, so neither construction nor the first
        # requests pay for them (copying a big vocabulary's tokenizer takes a good part of a
        # second).
        self._pool = ProcessorPool(
            lambda: self.hf_processor,
            self.workers,
            warm_up=options.warm_up,
            model=ctx.architecture,
        )
        # Requests answered from the cache tokenise on their callers' threads: with a copy of
        # the tokenizer each, as many at once as the prepare pool runs.
        self._front = TokenizerClones(
            self._tokenizer,
            io_workers,
            self._pool.original_lock,
            shared=lambda: self._pool.synchronous,
        )
        # With process workers, each HF call is lent one of as many worker processes as there
        # are worker threads; everything else (cache, single flight, prompt updates) stays here.
        self._processes: WorkerProcesses | None = None
        if worker_spec is not None:
            from mmproc.process_workers import WorkerProcesses

            self._processes = WorkerProcesses(
                worker_spec,
                self.workers,
                timeout_s=options.worker_timeout_s,
                model=ctx.model_name,
                background=options.warm_up != True,  # noqa: E712 (True, not "background")
            )
        self._hf = HFCalls(ctx, model, self._processes)

    def _learn_placeholders(self) -> dict[str, list[int]]:
        """Modality -> token ids of the model's placeholder for one item, for the modalities the
        model takes (a modality whose dummy text is empty is not one)."""
        found: dict[str, list[int]] = {}
        for modality in MODALITIES:
            text = self.model.get_dummy_text(self.ctx, {modality: 1})
            if text:
                found[modality] = list(self._tokenizer.encode(text, add_special_tokens=False))
        return found

    @property
    def media(self) -> MediaOptions:
        """How media items are read, fetched, decoded, sampled and converted for this model.
        Fixed for the processor's life: the keys of its cached encoded items depend on it."""
        return self._media

    @property
    def modalities(self) -> tuple[str, ...]:
        """The modalities the model takes, in :data:`mmproc.inputs.MODALITIES` order."""
        return tuple(self._placeholder_ids)

    @property
    def hash_algorithm(self) -> str:
        """The function item hashes and cache keys are made with (``hash_algorithm`` option)."""
        return self._keys.algorithm

    @property
    def norm_spec(self) -> NormSpec | None:
        """The device normalisation new requests get, or None when pixels are normalised here."""
        return self.normalization.active_spec

    # --- the pipeline ------------------------------------------------------------------------

    def process(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any] | None = None,
        hf_kwargs: Mapping[str, Any] | None = None,
        *,
        mm_uuids: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Preprocess one request: ``prompt`` (text or token ids) and its media.

        ``mm_uuids`` optionally names items, per modality one id (or None) per item, as vLLM's
        ``multi_modal_uuids``: a named item is keyed by its id instead of its content hash (see
        :mod:`mmproc.cache_keys` for the trust this asks of the caller).

        Media items are checked as :func:`mmproc.inputs.parse_mm_data` checks them, except that
        an item the cache answers is never decoded: one given encoded is read but not parsed,
        one named by an id is checked (its type and shape) but not decoded, and neither counts
        toward ``MediaLimits.max_request_decoded_bytes``. Items given decoded are loaded before
        the encoded ones the cache misses are parsed, so among several bad items an error about
        one given decoded comes first.
        """
        clock = self._new_clock()
        return self._run(self._route(self._prepare, (prompt, mm_data, hf_kwargs, mm_uuids), clock))

    async def process_async(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any] | None = None,
        hf_kwargs: Mapping[str, Any] | None = None,
        *,
        mm_uuids: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Like :meth:`process`, without blocking the event loop on loading or preprocessing."""
        clock = self._new_clock()
        route = self._route(self._prepare, (prompt, mm_data, hf_kwargs, mm_uuids), clock)
        return await self._run_async(route)

    def process_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        keep_control_tokens: bool = False,
        add_special_tokens: bool | None = None,
        mm_uuids: Mapping[str, Any] | None = None,
        hf_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Preprocess one chat request: OpenAI-style ``messages``, media in their content parts.

        The messages are rendered with the model's chat template (or ``chat_template``) and
        tokenised, and their media parts become the request's items in message order
        (:mod:`mmproc.chat.messages` lists the parts taken); then the request goes through the
        same pipeline, cache and media rules as :meth:`process`, and gives what it gives. Control
        tokens typed in the messages' text stay text (unless ``keep_control_tokens``): only the
        template's own tokens, and the placeholders of the media parts, act as such. A part's
        ``"uuid"`` names its item as ``mm_uuids`` would (give ids one way or the other). The
        tokenizer adds its special tokens (a BOS) unless the template wrote the BOS itself, as
        transformers' processors do (``add_special_tokens`` decides otherwise; vLLM's chat
        requests say False).

        Raises:
            ChatRequestError: a message or part that is wrong, or a media item of one that
                cannot be used, naming the message and the part (``ChatTemplateError`` when the
                template fails).
        """
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs or {},
            tools=tools,
            documents=documents,
            keep_control_tokens=keep_control_tokens,
            add_special_tokens=add_special_tokens,
        )
        return self._run(self._chat_route(messages, options, mm_uuids, hf_kwargs))

    async def process_chat_async(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        keep_control_tokens: bool = False,
        add_special_tokens: bool | None = None,
        mm_uuids: Mapping[str, Any] | None = None,
        hf_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Like :meth:`process_chat`, without blocking the event loop."""
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs or {},
            tools=tools,
            documents=documents,
            keep_control_tokens=keep_control_tokens,
            add_special_tokens=add_special_tokens,
        )
        return await self._run_async(self._chat_route(messages, options, mm_uuids, hf_kwargs))

    def _chat_route(
        self,
        messages: Any,
        options: ChatOptions,
        mm_uuids: Mapping[str, Any] | None,
        hf_kwargs: Mapping[str, Any] | None,
    ) -> _Route:
        """A chat request's steps: rendering it, then the steps of :meth:`_route`; an item's
        error names the message and the part it came from."""
        clock = self._new_clock()
        rendered: list[RenderedChat] = []

        def prepare(clock: StageClock) -> _Request | ProcessedInputs:
            clock.mark("hops")  # from the caller to the prepare pool, for async requests
            with self._front.borrow() as tokenizer:
                chat = self._chat.render(messages, options, tokenizer)
            rendered.append(chat)
            ids = chat.mm_uuids
            if ids is not None and mm_uuids is not None:
                raise ChatRequestError(
                    "item ids given twice, in the parts' 'uuid' and as mm_uuids: give them one way"
                )
            clock.mark("render")
            return self._prepare(
                chat.prompt_token_ids, chat.mm_data, hf_kwargs, ids or mm_uuids, clock
            )

        try:
            return (yield from self._route(prepare, (), clock))
        except MediaItemError as exc:
            if not rendered or exc.index is None:
                raise
            item = rendered[0].chat.locate(exc.modality, exc.index)
            if item is None:
                raise
            raise ChatRequestError(
                f"its {exc.modality} (item {exc.index} of the request): {exc.reason}",
                message_index=item.message_index,
                part_index=item.part_index,
                modality=exc.modality,
                item_index=exc.index,
            ) from exc

    def _route(
        self,
        prepare: Callable[..., _Request | ProcessedInputs],
        args: tuple[Any, ...],
        clock: StageClock,
    ) -> _Route:
        """The steps of one request, as a generator that :meth:`_run` and :meth:`_run_async`
        drive: each yields what to do next, and gets its result back."""
        answer = yield _OffLoop(prepare, (*args, clock))  # steps 1-3, decoding the misses
        if isinstance(answer, ProcessedInputs):
            return answer  # every item was cached
        request = answer
        # The media it left undecoded: the route's to close until handed to _after_waiting,
        # which closes it itself (also when the request is cancelled while it runs).
        media, request.media = request.media, None
        try:
            # Items other requests are computing right now: wait for them (the request left
            # them undecoded), then look them up again.
            waited = yield _WaitFor(request.miss_keys())
            if waited or media is not None:
                handed, media = media, None
                answer = yield _OffLoop(self._after_waiting, (request, handed))
                if isinstance(answer, ProcessedInputs):
                    return answer
        finally:
            if media is not None:  # abandoned while waiting (cancelled)
                media.close()
        result = yield _OnWorker(self._process_prepared, request)  # steps 4-6
        clock.mark("hops")
        return result

    def _run(self, route: _Route) -> ProcessedInputs:
        """Drive ``route`` on the calling thread."""
        # A request made from inside a worker's own call never waits: it could be waiting for
        # a claim of the request that made it.
        nested = getattr(self._thread_state, "processing", False)
        with contextlib.closing(route):
            step: _OffLoop | _WaitFor | _OnWorker | _Done = next(route)
            while not isinstance(step, _Done):
                try:
                    if isinstance(step, _OffLoop):
                        result: Any = step.fn(*step.args)
                    elif isinstance(step, _WaitFor):
                        result = not nested and self._in_flight.wait(step.keys)
                    else:
                        result = self._pool.run(step.fn, step.request)
                except Exception as exc:
                    step = _resume(route, exc)
                else:
                    step = _resume(route, result)
            return step.result

    async def _run_async(self, route: _Route) -> ProcessedInputs:
        """Drive ``route`` from the event loop, never blocking it."""
        loop = asyncio.get_running_loop()
        with contextlib.closing(route):
            step: _OffLoop | _WaitFor | _OnWorker | _Done = next(route)
            while not isinstance(step, _Done):
                try:
                    if isinstance(step, _OffLoop):
                        # Not on the IO pool itself: preparing waits for decode jobs it puts on
                        # that pool, and waiting inside the pool for the pool deadlocks once every
                        # IO thread does it.
                        result: Any = await loop.run_in_executor(
                            self._prepare_pool, step.fn, *step.args
                        )
                    elif isinstance(step, _WaitFor):
                        # On the loop: the prepare pool stays free for the requests behind it.
                        result = await self._in_flight.wait_async(step.keys)
                    else:
                        result = await self._pool.run_async(step.fn, step.request)
                except Exception as exc:
                    step = _resume(route, exc)
                else:
                    step = _resume(route, result)
            return step.result

    def _prepare(
        self,
        prompt: str | Sequence[int],
        mm_data: Mapping[str, Any] | None,
        hf_kwargs: Mapping[str, Any] | None,
        mm_uuids: Mapping[str, Any] | None,
        clock: StageClock = NO_CLOCK,
    ) -> _Request | ProcessedInputs:
        """Steps 1-3: read the items, decode those given decoded, key them and look them up;
        the answer itself when every item is cached. The misses are decoded too, unless another
        request is computing some of them: then they wait, undecoded, in ``request.media``."""
        clock.mark("hops")  # from the caller to the prepare pool, for async requests
        prompt = self._checked_prompt(check_prompt(prompt))
        user_kwargs = dict(hf_kwargs or {})
        raw = self.normalization.raw_pixels_for(user_kwargs)
        digest = self._keys.context_digest(user_kwargs, raw)
        ids: dict[str, list[str | None]] = {}

        def check_counts(counts: Mapping[str, int]) -> None:
            # Before any file is opened or URL fetched: a refused request reads nothing.
            self._check_modalities(counts)
            ids.update(check_mm_uuids(mm_uuids, counts))

        read = read_mm_data(
            mm_data,
            io_pool=self._io_pool,
            media=self._media,
            max_items=self.ctx.processor_options.max_items_per_request,
            check_counts=check_counts,
        )
        kept = False  # whether the request keeps its media open, to decode after its wait
        try:
            items = self._decode_given(read, ids)
            clock.mark("parse")
            for item in items:
                item.key, item.hash = self._key(digest, item, ids, read, bool(user_kwargs))
            clock.mark("hash")
            keys = [item.key for item in items]
            request = _Request(prompt, items, self._lookup(keys), user_kwargs, raw, clock=clock)
            clock.mark("lookup")
            if self._all_cached(request):
                return self._answer_from_cache(request)
            # What others compute right now this request will most likely find in the cache
            # once it has waited for them: it leaves its misses undecoded until then.
            if self._in_flight.claimed(request.miss_keys()):
                request.media, kept = read, True
            else:
                self._decode_misses(request, read)
            return request
        finally:
            if not kept:
                read.close()

    def _decode_given(
        self, read: ReadMediaItems, ids: Mapping[str, list[str | None]]
    ) -> list[_Item]:
        """The request's items, those given decoded loaded: their key is their content. An item
        given encoded is keyed by its bytes, and one named by the caller by its id: neither is
        decoded here."""
        named = {(m, i) for m, modality_ids in ids.items() for i, v in enumerate(modality_ids) if v}
        refs = read.refs()
        loaded = read.decode(ref for ref in refs if read.source(ref) is None and ref not in named)
        return [
            _Item(m, i, "", "", loaded.get((m, i), _UNDECODED), read.given((m, i))) for m, i in refs
        ]

    def _key(
        self,
        digest: bytes,
        item: _Item,
        ids: Mapping[str, list[str | None]],
        read: ReadMediaItems,
        has_user_kwargs: bool,
    ) -> tuple[str, str]:
        """An item's cache key and the hash its feature shows."""
        modality_ids = ids.get(item.modality)
        item_id = modality_ids[item.index] if modality_ids else None
        if item_id is not None:
            key = self._keys.id_key(digest, item.modality, item_id)
            # The engine keys its caches on the hash: an id stands for itself unless the
            # request's hf_kwargs shape the outputs, which the key then covers.
            return key, key if has_user_kwargs else item_id
        source = read.source((item.modality, item.index))
        if source is not None:
            key = self._keys.source_key(digest, item.modality, source)
        else:
            key = self._keys.content_key(digest, item.modality, item.value)
        return key, key

    def _decode_misses(self, request: _Request, read: ReadMediaItems) -> None:
        """Decode the items the request computes (the first of each distinct key it misses)."""
        todo = [item for item in request.to_compute() if item.value is _UNDECODED]
        if todo:
            decoded = read.decode((item.modality, item.index) for item in todo)
            for item in todo:
                item.value = decoded[item.modality, item.index]
        request.clock.mark("decode")

    def _after_waiting(
        self, request: _Request, media: ReadMediaItems | None
    ) -> _Request | ProcessedInputs:
        """A request whose items others were computing: what they left in the cache is a hit
        now; the answer itself when that is every item. The ``media`` it left undecoded for
        them and still misses are decoded now (and ``media`` closed)."""
        request.clock.mark("hops")  # the wait, and for async requests the hop back
        try:
            if self.cache.enabled:
                request.cached.update(self._lookup(request.miss_keys(), retry=True))
                request.clock.mark("lookup")
            if self._all_cached(request):
                return self._answer_from_cache(request)
            if media is not None:
                self._decode_misses(request, media)
            return request
        finally:
            if media is not None:
                media.close()

    def _all_cached(self, request: _Request) -> bool:
        # The synchronous fallback runs every request on the original processor, whose tokenizer
        # the cache path shares: it goes through the pool too.
        return not request.misses() and not self._pool.synchronous

    def _checked_prompt(self, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, str):
            self._check_prompt_length(len(prompt), "characters")
        else:
            self._check_prompt_length(len(prompt), "tokens")
        return prompt

    def _check_prompt_length(self, length: int, unit: str) -> None:
        """Refuse a prompt over ``max_prompt_chars`` (text) or ``max_prompt_tokens``."""
        options = self.ctx.processor_options
        name = "max_prompt_chars" if unit == "characters" else "max_prompt_tokens"
        limit = getattr(options, name)
        if limit is not None and length > limit:
            raise PromptUpdateError(
                f"the prompt has {length:,} {unit}, over the limit of {limit:,} (the {name} option)"
            )

    def _check_modalities(self, counts: Mapping[str, int]) -> None:
        for modality in counts:
            if modality not in self._placeholder_ids:
                takes = ", ".join(self._placeholder_ids) or "no media"
                raise MediaItemError(
                    modality,
                    None,
                    f"{self.ctx.model_name} takes no {modality} items; it takes {takes}",
                )

    def _lookup(self, keys: list[str], *, retry: bool = False) -> dict[str, CachedItem]:
        """The cached items of those ``keys`` that hit (``retry``: see `ProcessorCache.lookup`)."""
        found = self.cache.lookup(keys, retry=retry)
        return {key: item for key, item in zip(keys, found) if item is not None}

    def _answer_from_cache(self, request: _Request) -> ProcessedInputs:
        # get_prompt_outputs reads the original processor (its hook may not call it), so it is
        # shared; the tokenizer is called, so it is borrowed.
        with self._front.borrow() as tokenizer:
            return self._assemble(request, request.cached, self.hf_processor, tokenizer, None)

    def _process_prepared(self, request: _Request, *, processor: Any) -> ProcessedInputs:
        """Steps 4-6, on a worker thread with that thread's processor clone."""
        request.clock.mark("hops")
        if self.cache.enabled and (misses := request.miss_keys()):
            # Whatever other requests finished since this one was prepared (or while it waited
            # for them) is a hit now; the rest is claimed, so that requests arriving from here on
            # wait for it instead of computing it too.
            request.cached.update(self._lookup(misses, retry=True))
            request.owned = self._in_flight.claim(k for k in misses if k not in request.cached)
            request.clock.mark("lookup")
        state = self._thread_state
        nested = getattr(state, "processing", False)
        state.processing = True
        try:
            entries = dict(request.cached)
            expanded_ids: list[int] | None = None
            if to_compute := request.to_compute():
                computed, expanded_ids = self._compute_missing(request, to_compute, processor)
                entries.update(computed)
            return self._assemble(
                request, entries, processor, tokenizer_of(processor), expanded_ids
            )
        finally:
            state.processing = nested
            self._in_flight.release(request.owned)  # also when processing failed

    def _assemble(
        self,
        request: _Request,
        entries: Mapping[str, CachedItem],
        processor: Any,
        tokenizer: Any,
        expanded_ids: list[int] | None,
    ) -> ProcessedInputs:
        """Steps 5-6: expand the prompt with every item's resolved update, the features and the
        prompt's own outputs."""
        resolved = {
            modality: [entries[key].prompt_updates for key in request.keys_of(modality)]
            for modality in request.mm_counts
        }
        if expanded_ids is not None:
            prompt_ids = expanded_ids
            try:
                placeholders = find_resolved_ranges(prompt_ids, resolved, tokenizer)
            except PromptUpdateError as exc:
                raise PromptUpdateError(
                    f"{exc}: the HF processor expanded the prompt, and not as the plugin's "
                    f"prompt updates say ({self.ctx.architecture}, plugin {self.ctx.plugin!r}: "
                    "check its get_prompt_updates hook)",
                    modality=exc.modality,
                    item_index=exc.item_index,
                ) from exc
        else:
            if isinstance(request.prompt, str):
                ids: list[int] = list(tokenizer(request.prompt)["input_ids"])
                request.clock.mark("tokenize")
            else:
                ids = request.prompt
            self._check_prompt_length(len(ids), "tokens")
            check_unused_placeholders(ids, self._placeholder_ids, request.mm_counts)
            check_placeholder_count(ids, resolved, tokenizer)
            new_prompt, placeholders = apply_resolved_updates(ids, resolved, tokenizer)
            assert not isinstance(new_prompt, str)  # token ids in, token ids out
            prompt_ids = new_prompt
        by_ref = {(item.modality, item.index): item for item in request.items}
        features = []
        for modality, ranges in placeholders.items():
            for index, placeholder in enumerate(ranges):
                item = by_ref[modality, index]
                data = entries[item.key].feature_data()
                features.append(
                    MultiModalFeature(
                        modality=modality,
                        item_index=index,
                        hash=item.hash,
                        data=data,
                        placeholder=placeholder,
                        norm=self.normalization.norm_of(data),
                        cache_key=item.key,
                    )
                )
        features.sort(key=lambda f: f.placeholder.offset)
        request.clock.mark("expand")
        prompt_outputs = self.model.get_prompt_outputs(
            self.ctx, processor, prompt_ids, placeholders
        )
        request.clock.mark("prompt_outputs")
        return ProcessedInputs(prompt_ids, features, prompt_outputs)

    def keep_stand_ins(self, features: Iterable[MultiModalFeature]) -> int:
        """Keep only the metadata of these items in the cache (their stand-ins, see
        :mod:`mmproc.cache`): for items an engine now holds, so that a request that repeats one
        sends it by reference without the server keeping its tensors too. How many were swapped
        (features not from this processor's cache, or already stand-ins, are left alone)."""
        return sum(
            self.cache.keep_stand_in(feature.cache_key, feature.data)
            for feature in features
            if feature.cache_key
        )

    def drop_stand_ins(self, features: Iterable[MultiModalFeature]) -> int:
        """Forget the stand-ins of these items (their engine lacks them after all), so that the
        next request with them computes them again; how many were dropped."""
        return sum(
            self.cache.drop_stand_in(feature.cache_key) for feature in features if feature.cache_key
        )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` as the model's tokenizer gives it (with its BOS and the like unless
        ``add_special_tokens`` is False), on a copy no other thread uses meanwhile; refused over
        ``max_prompt_chars``."""
        self._check_prompt_length(len(text), "characters")
        with self._front.borrow() as tokenizer:
            return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def hf_call_kwargs(self, hf_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The keyword arguments the HF processor gets for a request with these ``hf_kwargs``
        (the device, the raw-pixel switches, then the caller's own): to call it as the pipeline
        does, e.g. to compare against it."""
        user_kwargs = dict(hf_kwargs or {})
        return self._hf_kwargs(user_kwargs, self.normalization.raw_pixels_for(user_kwargs))

    def _hf_kwargs(self, user_kwargs: Mapping[str, Any], raw: bool) -> dict[str, Any]:
        """What the HF processor gets: the device of a fast processor, the raw-pixel switches,
        then the caller's own."""
        kwargs = dict(self._base_kwargs)
        if raw:
            from mmproc.fused_norm import raw_pixel_kwargs

            kwargs.update(raw_pixel_kwargs())
        kwargs.update(user_kwargs)
        return kwargs

    def _compute_missing(
        self, request: _Request, to_compute: list[_Item], processor: Any
    ) -> tuple[dict[str, CachedItem], list[int] | None]:
        """Step 4: run the HF processor on the items not in the cache; cache their outputs with
        their resolved prompt updates. Returns the new items by key, and the prompt ids when HF
        expanded the prompt."""
        ctx, model = self.ctx, self.model
        items: dict[str, list[Any]] = {}
        for item in to_compute:
            items.setdefault(item.modality, []).append(item.value)
        counts = {m: len(v) for m, v in items.items()}
        use_prompt = (
            self.ctx.processor_options.hf_prompt_expansion
            and isinstance(request.prompt, str)
            and not request.cached
            and counts == request.mm_counts
        )
        mode = ProcessingMode(
            media_only=not use_prompt,
            raw_pixels=request.raw,
            device=self.device,
            user_kwargs=request.user_kwargs,
        )
        kwargs = self._hf_kwargs(request.user_kwargs, request.raw)
        refs = [(item.modality, item.index, item.value) for item in to_compute]
        clock = request.clock
        expanded_ids = None
        per_item = None
        if use_prompt:
            assert isinstance(request.prompt, str)
            try:
                per_item, expanded_ids = self._hf.call(
                    mode, request.prompt, items, kwargs, processor
                )
            except WorkerProcessError:
                raise  # the worker's fault, not the prompt's: no second try
            except ProcessingError:
                # Most often the prompt and the items disagree: the dummy-text path below says
                # so precisely (PromptUpdateError), or finds the item at fault.
                mode = dataclasses.replace(mode, media_only=True)
        if per_item is None:
            per_item = self._hf.media_only(refs, mode, kwargs, processor)
        clock.mark("hf_call")
        cacheable = True
        if request.raw and not self.normalization.to_uint8(per_item):
            # Neither raw nor trustworthy: rerun these items on the float path.
            mode = dataclasses.replace(mode, raw_pixels=False, media_only=True)
            kwargs = self._hf_kwargs(request.user_kwargs, raw=False)
            per_item = self._hf.media_only(refs, mode, kwargs, processor)
            expanded_ids = None
            cacheable = False  # their keys say "raw": never serve floats under them
        clock.mark("split")
        updates = model.get_prompt_updates(ctx, processor, items, per_item)
        resolved = resolve_prompt_updates(updates, counts)
        clock.mark("prompt_updates")
        to_cache = cacheable and self.cache.enabled
        position = {m: 0 for m in counts}
        computed: dict[str, CachedItem] = {}
        for item in to_compute:
            i = position[item.modality]
            position[item.modality] += 1
            computed[item.key] = CachedItem.of(
                per_item[item.modality][i], resolved[item.modality][i], compact=to_cache
            )
        if to_cache:
            # One compact copy per item, shared by the cache and this request's features, so the
            # batch tensor is freed with the request rather than held by views.
            self.cache.insert(computed, protect=[*request.cached, *computed])
            # The results are in the cache (or refused by it): waiters need not wait for the rest
            # of this request. Released claims leave `owned`, so they cannot be released twice.
            done = {key: request.owned.pop(key) for key in computed if key in request.owned}
            self._in_flight.release(done)
        clock.mark("cache_insert")
        return computed, expanded_ids

    # --- stage timing ------------------------------------------------------------------------

    def _new_clock(self) -> StageClock:
        log = self._stage_log
        return NO_CLOCK if log is None else log.new_clock()

    @contextlib.contextmanager
    def recording_stages(self) -> Iterator[StageLog]:
        """Record where each request started inside the ``with`` block spends its time.

        Yields a :class:`mmproc.stages.StageLog` that collects one
        :class:`~mmproc.stages.StageClock` per request (seconds per stage of
        :data:`mmproc.stages.STAGES`); ``mmproc bench --stages`` prints them. Outside a
        recording the pipeline's marks cost nothing.
        """
        log = StageLog()
        self._stage_log = log
        try:
            yield log
        finally:
            self._stage_log = None

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def pool(self) -> ProcessorPool:
        """The worker pool running this processor's HF calls."""
        return self._pool

    def warm_up(self) -> None:
        """Make every worker's processor clone now, so the first requests do not pay for it."""
        self._pool.warm_up()

    def close(self) -> None:
        """Stop the worker and IO threads (waits for running requests), and the worker
        processes."""
        self._pool.shutdown()
        if self._processes is not None:
            self._processes.close()
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
