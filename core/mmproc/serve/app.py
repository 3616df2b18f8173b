"""The render service as an ASGI application (Starlette), around one :class:`~mmproc.Processor`.

Endpoints: ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render`` (vLLM's
render format, :mod:`mmproc.serve.protocol`), ``GET /health``, ``GET /v1/models``, ``GET
/metrics`` (Prometheus text, :mod:`mmproc.serve.metrics`).

What each request goes through, and what it may cost:

* a ``Content-Length`` over ``max_body_bytes`` is refused at once (413), as is a content type
  other than JSON;
* it takes a place among the ``max_concurrency + max_queue`` requests the server admits, or is
  refused at once (503 with ``Retry-After``) when they are all taken: nothing of its body is
  read before it has a place, so the bodies held at once are bounded;
* its body is read, up to ``max_body_bytes`` (413 over it), within ``request_timeout_s`` (408
  past it): the time a body takes to arrive is the request's time;
* it waits for one of ``max_concurrency`` render slots, then is parsed (400 for JSON that is
  not an object of the right fields; a large body is parsed off the event loop) and rendered
  within what is left of ``request_timeout_s`` (504 past it): the chat template, the media
  (decoded on the processor's IO pool, preprocessed on its workers, cached), and the answer —
  items in vLLM's ``kwargs_data`` (an item's encoding kept in a byte-bounded LRU from its second
  time on, so an image repeated again is answered without encoding it), or, with an engine, the
  request sent over mmproc's wire under an id of the server's own and answered once the engine
  acknowledged it (502 when it refused it or never acknowledged it).

Every refusal is OpenAI's error JSON. A fault of the request is a 400 naming the field, the
message and the part (``param``: ``messages[1].content[0]``, ``tools[2]``); a fault on the
server's side (the model's processor failing, a plugin's hook that is wrong, a model folder with
no chat template) is a 500 saying only that, its traceback logged here; a worker process that
died under a request is a 503 with ``Retry-After``. No traceback ever reaches a client. One bad
request never affects another.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from mmproc.chat.template import find_chat_template
from mmproc.errors import (
    ChatRequestError,
    ChatTemplateError,
    EncodeError,
    MediaItemError,
    MmprocError,
    PromptUpdateError,
    WorkerProcessError,
)
from mmproc.fields import FieldSpec
from mmproc.processed import ProcessedInputs
from mmproc.processor import Processor
from mmproc.serve.allocator import make_room
from mmproc.serve.engine_link import EngineLacksItems, EngineLink, EngineRefused
from mmproc.serve.metrics import ServerMetrics
from mmproc.serve.protocol import (
    BadRequest,
    error_body,
    generate_request,
    parse_chat,
    parse_completion,
)
from mmproc.serve.vllm_items import encode_item, encode_metadata

__all__ = ["ServeSettings", "create_app"]

logger = logging.getLogger(__name__)

_DEFAULT_PIXEL_KEYS = frozenset({"pixel_values", "pixel_values_videos"})
# Bodies larger than this are parsed and checked on a thread, off the loop all requests share.
_PARSE_OFF_LOOP_BYTES = 1 << 20
# Connections uvicorn takes beyond the admitted requests: for /health, /metrics, /v1/models.
_PROBE_CONNECTIONS = 64
# Sends of one request on the native path: the second renders it again with its items' tensors,
# when the engine lacked items the cache kept only stand-ins of (a third would only race the
# engine's evictions again).
_STAND_IN_ATTEMPTS = 2


@dataclass(frozen=True)
class ServeSettings:
    """How the server takes its requests (the ``mmproc serve`` options).

    ``served_model_names``
        the names a request's ``model`` may say (the first is what ``/v1/models`` lists first).
    ``max_model_len``
        the model's context, for the default ``max_tokens`` (None: no default).
    ``max_body_bytes``
        the largest request body (default 64 MiB). The bodies held at once are at most
        ``(max_concurrency + max_queue) * max_body_bytes``: size the three to the host.
    ``max_concurrency`` / ``max_queue``
        requests rendered at once (default 64), and admitted beyond them (default 256): waiting
        for a render slot, or their bodies still arriving.
    ``request_timeout_s``
        the longest a request may take, from its first byte of body to its answer, its wait for
        a render slot aside (default 60 s).
    ``trust_request_chat_template``
        accept a ``chat_template`` in requests (default no: it is code the server runs).
    ``trust_request_ids``
        take a content part's ``"uuid"`` as the id of its item (vLLM's ``multi_modal_uuids``:
        the processor's cache and the answer's ``mm_hashes`` then key the item by it, and a part
        may leave its data out when the cache holds it). Default no: every item is keyed by its
        content and a part's ``uuid`` is dropped, since with ids taken one client could fetch,
        by naming its id, what another client sent. Only for callers that share one tenant (an
        engine's own front end, whose ids are namespaced already).
    ``engine``
        an ``ipc://`` or ``tcp://`` address: send every rendered request to the engine over
        mmproc's wire instead of answering its tensors.
    ``engine_ack_timeout_s`` / ``engine_max_attempts``
        how long the engine has to acknowledge a request before it is sent again, and how many
        sends before the HTTP request fails (502); default: the wire's.
    ``engine_item_cache_bytes``
        the bytes of items the engine's receiver keeps (its ``item_cache_bytes``; default the
        wire's, 1 GiB; 0: it keeps none, so every item goes in full and the server keeps whole
        items): what the server takes it to hold, and so sends by reference and keeps only
        stand-ins of. Set it to the receiver's: a larger guess costs a render again for each
        item guessed wrong.
    ``encoded_item_cache_bytes``
        bytes of encoded items kept for repeated media, each from its second time on (default
        1 GiB; 0: none; ``mmproc serve --encoded-item-cache-bytes``).
    """

    served_model_names: tuple[str, ...]
    max_model_len: int | None = None
    max_body_bytes: int = 64 << 20
    max_concurrency: int = 64
    max_queue: int = 256
    request_timeout_s: float = 60.0
    trust_request_chat_template: bool = False
    trust_request_ids: bool = False
    engine: str | None = None
    engine_ack_timeout_s: float | None = None
    engine_max_attempts: int | None = None
    engine_item_cache_bytes: int | None = None
    encoded_item_cache_bytes: int = 1 << 30

    @property
    def connection_limit(self) -> int:
        """The connections to let uvicorn keep at once (``limit_concurrency``; it answers 503
        beyond them): every request the server admits, and some for health checks and
        scrapes."""
        return self.max_concurrency + self.max_queue + _PROBE_CONNECTIONS


_Pieces = list[bytes]  # an encoded item: ASCII pieces whose concatenation is its base64


def _size(pieces: _Pieces | None) -> int:
    return sum(len(piece) for piece in pieces or ())


class _Busy(Exception):
    """Every render slot is taken and the queue is full."""


class _BodyTimeout(Exception):
    """The request's body did not arrive in time."""


class _ServerFault(Exception):
    """A request the server cannot serve for a fault of its own (a 500, whoever asks)."""


_Checked = TypeVar("_Checked")
_Render = Callable[[bytes, Request], Awaitable[Response]]  # a route's body -> its answer


class _EncodedItems:
    """Items already encoded in vLLM's format, by hash: a byte-bounded LRU that keeps an item's
    encoding from its second time on.

    Most items of a render tier come once (a new photo in each request). Keeping the encoding of
    each would take new memory for every such request, pages the kernel must fault in and zero,
    which costs more than encoding a repeat again; so the first encoding of a key is only noted
    (among the last ``_NOTED_KEYS`` keys) and the second one is kept.
    """

    _NOTED_KEYS = 1 << 16

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._items: OrderedDict[tuple[str, str], tuple[_Pieces, _Pieces | None]] = OrderedDict()
        self._noted: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple[str, str]) -> tuple[_Pieces, _Pieces | None] | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple[str, str], value: tuple[_Pieces, _Pieces | None]) -> None:
        size = _size(value[0]) + _size(value[1])
        if size > self._max:
            return
        with self._lock:
            if key in self._items:
                return
            if key not in self._noted:  # its first time: noted, not kept
                self._noted[key] = None
                if len(self._noted) > self._NOTED_KEYS:
                    self._noted.popitem(last=False)
                return
            del self._noted[key]
            self._items[key] = value
            self._bytes += size
            while self._bytes > self._max:
                _, (data, meta) = self._items.popitem(last=False)
                self._bytes -= _size(data) + _size(meta)


class _Server:
    """The state behind the routes: the processor, admission, the encoded items, the engine."""

    def __init__(self, processor: Processor, settings: ServeSettings) -> None:
        self.processor = processor
        self.settings = settings
        self.metrics = ServerMetrics(processor)
        self.encoded = _EncodedItems(settings.encoded_item_cache_bytes)
        self.engine: EngineLink | None = None
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self._admitted = 0
        self._fields: dict[tuple[str, frozenset[str]], Mapping[str, FieldSpec]] = {}
        self._max_text_chars = processor.ctx.processor_options.max_prompt_chars
        tokenizer = getattr(processor.hf_processor, "tokenizer", processor.hf_processor)
        self._max_token_id = _max_token_id(tokenizer)
        # A model folder without the template a chat needs fails every such chat the same way:
        # found out here, said once in the log, and each of those chats is a 500.
        self._template_fault = {
            tools: _template_fault(processor.hf_processor, tokenizer, with_tools=tools)
            for tools in (False, True)
        }
        for fault in dict.fromkeys(f for f in self._template_fault.values() if f):
            logger.warning("mmproc serve: %s; chat requests that need it will fail (500)", fault)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        settings = self.settings
        if settings.engine is not None:
            options: dict[str, Any] = {}
            if settings.engine_ack_timeout_s is not None:
                options["ack_timeout"] = settings.engine_ack_timeout_s
            if settings.engine_max_attempts is not None:
                options["max_attempts"] = settings.engine_max_attempts
            if settings.engine_item_cache_bytes is not None:
                options["item_cache_bytes"] = settings.engine_item_cache_bytes
            self.engine = EngineLink(settings.engine, **options)
            self.metrics.watch_engine(self.engine)
        try:
            yield
        finally:
            # After uvicorn has drained the requests in flight (SIGTERM, Ctrl-C).
            if self.engine is not None:
                self.engine.close()
            self.processor.close()

    # --- admission -------------------------------------------------------------------------

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """A place among the requests the server holds (rendering, waiting for a slot, or
        their bodies arriving), or :class:`_Busy` at once."""
        if self._admitted >= self.settings.max_concurrency + self.settings.max_queue:
            raise _Busy
        self._admitted += 1
        try:
            yield
        finally:
            self._admitted -= 1

    # --- the routes ------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, "chat", self._render_chat)

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions", self._render_completions)

    async def health(self, request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "mmproc",
                "root": self.settings.served_model_names[0],
                "max_model_len": self.settings.max_model_len,
            }
            for name in self.settings.served_model_names
        ]
        return _json({"object": "list", "data": data})

    async def metrics_endpoint(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def _handle(self, request: Request, endpoint: str, render: _Render) -> Response:
        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            try:
                answer = await self._admit_and_render(request, endpoint, render, start)
            except BadRequest as exc:
                return self._error(endpoint, exc.kind, str(exc), exc.status, exc.param)
            except _Busy:
                response = self._error(
                    endpoint, "ServiceUnavailableError", "the server is busy: retry later", 503
                )
                response.headers["Retry-After"] = "1"
                return response
            except _BodyTimeout:
                return self._error(
                    endpoint,
                    "TimeoutError",
                    f"the request body did not arrive within {self.settings.request_timeout_s:g} s",
                    408,
                )
            except TimeoutError:
                return self._error(
                    endpoint,
                    "TimeoutError",
                    f"the request took longer than {self.settings.request_timeout_s:g} s",
                    504,
                )
            except ClientDisconnect:
                # Nobody reads this answer: counted (as nginx's 499, the client closed the
                # request), not logged, since any client can do it at will.
                return self._error(endpoint, "ClientDisconnect", "the client went away", 499)
            except EngineRefused as exc:
                return self._error(endpoint, "EngineError", str(exc), 502)
            except MmprocError as exc:
                return self._mmproc_error(endpoint, exc)
            except _ServerFault as exc:
                return self._error(endpoint, "InternalServerError", str(exc), 500)
            except RecursionError:
                # The bounds on nesting should leave nothing to get here; if something does, it
                # is still the request's shape, not the server's fault.
                return self._error(
                    endpoint, "BadRequestError", "the request is nested too deeply", 400
                )
            except Exception:
                logger.exception("an unexpected error while rendering a %s request", endpoint)
                return self._error(endpoint, "InternalServerError", "internal server error", 500)
            self.metrics.requests.labels(endpoint, "200").inc()
            self.metrics.observe(endpoint, "total", time.perf_counter() - start)
            return answer
        finally:
            self.metrics.in_flight.dec()

    async def _admit_and_render(
        self, request: Request, endpoint: str, render: _Render, start: float
    ) -> Response:
        """Admission, the body, a render slot, then ``render(body, request)``, in that order:
        nothing is read for a request the server has no place for."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(
                f"the request body is over {limit:,} bytes", status=413, kind="RequestTooLarge"
            )
        content_type = request.headers.get("content-type", "application/json")
        if not content_type.split(";")[0].strip().lower() == "application/json":
            raise BadRequest(
                f"Unsupported Media Type: {content_type[:64]!r}, expected application/json"
            )
        budget = self.settings.request_timeout_s
        with self.admitted():
            make_room()  # the heap's reserve, for what this request will keep
            began = time.perf_counter()
            try:
                raw = await asyncio.wait_for(self._read_body(request), budget)
            except TimeoutError:
                raise _BodyTimeout from None
            async with self._slots:
                self.metrics.observe(endpoint, "queue", time.perf_counter() - start)
                left = budget - (time.perf_counter() - began)
                return await asyncio.wait_for(render(raw, request), max(left, 0.0))

    def _error(
        self, endpoint: str, kind: str, message: str, status: int, param: Any = None
    ) -> Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.errors.labels(endpoint, kind).inc()
        return _json(error_body(message, kind, status, param), status=status)

    def _mmproc_error(self, endpoint: str, exc: MmprocError) -> Response:
        """An mmproc error as the fault it is: the request's (400), a worker process lost under
        it (503), or the server's (500, logged)."""
        if isinstance(exc, ChatRequestError):
            return self._error(endpoint, "BadRequestError", str(exc), 400, _chat_param(exc))
        if isinstance(exc, MediaItemError | PromptUpdateError):
            return self._error(endpoint, "BadRequestError", str(exc), 400)
        if isinstance(exc, WorkerProcessError):
            logger.warning("a %s request lost its worker process: %s", endpoint, exc)
            response = self._error(
                endpoint,
                "ServiceUnavailableError",
                "a preprocessing worker failed under the request: retry it",
                503,
            )
            response.headers["Retry-After"] = "1"
            return response
        logger.error("a %s request failed on the server's side", endpoint, exc_info=exc)
        return self._error(
            endpoint,
            "InternalServerError",
            "the server failed to process the request (its fault, logged there)",
            500,
        )

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(
                    f"the request body is over {limit:,} bytes", status=413, kind="RequestTooLarge"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parsed(self, raw: bytes, check: Callable[[Any], _Checked]) -> _Checked:
        """``check`` (one of protocol's parsers) of the JSON in ``raw``; on a thread for a large
        body, which also takes long to check."""

        def parse() -> _Checked:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise BadRequest(f"the request body is not valid JSON: {exc}") from None
            return check(body)

        if len(raw) <= _PARSE_OFF_LOOP_BYTES:
            return parse()
        return await asyncio.get_running_loop().run_in_executor(None, parse)

    # --- rendering -------------------------------------------------------------------------

    async def _render_chat(self, raw: bytes, request: Request) -> Response:
        settings = self.settings
        chat = await self._parsed(
            raw,
            functools.partial(
                parse_chat,
                served=settings.served_model_names,
                header_request_id=request.headers.get("x-request-id"),
                trust_chat_template=settings.trust_request_chat_template,
                trust_request_ids=settings.trust_request_ids,
                max_text_chars=self._max_text_chars,
            ),
        )
        if "chat_template" not in chat.chat_kwargs:
            fault = self._template_fault[bool(chat.chat_kwargs.get("tools"))]
            if fault is not None:
                raise _ServerFault(f"the server cannot render chats: {fault}")

        async def render() -> ProcessedInputs:
            begin = time.perf_counter()
            inputs = await self.processor.process_chat_async(chat.messages, **chat.chat_kwargs)
            self.metrics.observe("chat", "render", time.perf_counter() - begin)
            return inputs

        inputs, features, engine_id = await self._deliver(
            await render(), render, chat.request_id, chat.sampling, chat.with_tensors, "chat"
        )
        answer = generate_request(
            request_id=chat.request_id,
            token_ids=inputs.prompt_token_ids,
            features=features,
            sampling=chat.sampling,
            max_model_len=settings.max_model_len,
            model=settings.served_model_names[0],
            passed=chat.passed,
            stream=chat.stream,
            parse_context=chat.parse_context,
            engine_request_id=engine_id,
        )
        return await self._respond(answer, "chat")

    async def _render_completions(self, raw: bytes, request: Request) -> Response:
        settings = self.settings
        completion = await self._parsed(
            raw,
            functools.partial(
                parse_completion,
                served=settings.served_model_names,
                header_request_id=request.headers.get("x-request-id"),
                max_text_chars=self._max_text_chars,
                max_token_id=self._max_token_id,
            ),
        )
        answers = []
        loop = asyncio.get_running_loop()
        for index, prompt in enumerate(completion.prompts):
            request_id = completion.request_id
            if len(completion.prompts) > 1:
                request_id += f"-{index}"
            begin = time.perf_counter()
            if isinstance(prompt, str):
                ids = await loop.run_in_executor(
                    None, self.processor.tokenize, prompt, completion.add_special_tokens
                )
            else:
                ids = prompt
            inputs = await self.processor.process_async(ids)
            self.metrics.observe("completions", "render", time.perf_counter() - begin)
            # No media: nothing a stand-in could stand for, so never rendered again.
            inputs, _, engine_id = await self._deliver(
                inputs, None, request_id, completion.sampling, False, "completions"
            )
            answers.append(
                generate_request(
                    request_id=request_id,
                    token_ids=inputs.prompt_token_ids,
                    features=None,
                    sampling=completion.sampling,
                    max_model_len=settings.max_model_len,
                    model=settings.served_model_names[0],
                    passed=completion.passed,
                    stream=completion.stream,
                    parse_context=None,
                    engine_request_id=engine_id,
                )
            )
        return await self._respond(answers, "completions")

    async def _deliver(
        self,
        inputs: ProcessedInputs,
        render: Callable[[], Awaitable[ProcessedInputs]] | None,
        request_id: str,
        sampling: Mapping[str, Any],
        with_tensors: bool,
        endpoint: str,
    ) -> tuple[ProcessedInputs, dict[str, Any] | None, str | None]:
        """The request as answered (on the native path ``render`` makes it again should the
        engine lack items of it), the answer's ``features``, and the engine request id on the
        native path (where the request went to the engine and the answer carries no tensors)."""
        engine_id = None
        if self.engine is not None:
            inputs, engine_id = await self._send_to_engine(
                inputs, render, request_id, sampling, endpoint
            )
            with_tensors = False
        if not inputs.features:
            return inputs, None, engine_id
        begin = time.perf_counter()
        features: dict[str, Any] = {"mm_hashes": {}, "mm_placeholders": {}}
        for feature in inputs.features:
            features["mm_hashes"].setdefault(feature.modality, []).append(feature.hash)
            features["mm_placeholders"].setdefault(feature.modality, []).append(
                {"offset": feature.placeholder.offset, "length": feature.placeholder.length}
            )
        if with_tensors:
            encoded = self._encode_items(inputs)
            features["kwargs_data"], features["mm_metadata"] = encoded
        else:
            features["kwargs_data"] = features["mm_metadata"] = None
        self.metrics.observe(endpoint, "encode", time.perf_counter() - begin)
        return inputs, features, engine_id

    async def _send_to_engine(
        self,
        inputs: ProcessedInputs,
        render: Callable[[], Awaitable[ProcessedInputs]] | None,
        request_id: str,
        sampling: Mapping[str, Any],
        endpoint: str,
    ) -> tuple[ProcessedInputs, str]:
        """Send the request to the engine under an id of the server's own; the request as sent
        (made again by ``render`` should the engine lack items the cache kept only stand-ins
        of) and that id.

        Once the engine holds an item, the processor's cache keeps only its stand-in: the
        engine has its tensors, and holding them here as well would double the memory and make
        every new item cost fresh pages while the cache fills."""
        assert self.engine is not None
        begin = time.perf_counter()
        for attempt in range(_STAND_IN_ATTEMPTS):
            # Request ids are the clients' to choose: the engine gets one of the server's own.
            engine_id = self.engine.new_request_id(request_id)
            engine_request = inputs.to_engine_request(engine_id, dict(sampling))
            try:
                await self.engine.send(engine_request, timeout=self.settings.request_timeout_s)
            except EncodeError as exc:
                # The processor's outputs always encode: what does not is what the request
                # added, its sampling parameters (the wire nests less deeply than JSON).
                raise BadRequest(f"the request cannot be sent to the engine: {exc}") from None
            except EngineLacksItems:
                if render is None or attempt + 1 == _STAND_IN_ATTEMPTS:
                    raise
                self.metrics.count_stand_in_miss(endpoint)
                self.processor.drop_stand_ins(inputs.features)
                inputs = await render()
                continue
            break
        if inputs.features:
            held = self.engine.holds(engine_request)
            self.processor.keep_stand_ins(f for f, h in zip(inputs.features, held) if h)
        self.metrics.observe(endpoint, "engine", time.perf_counter() - begin)
        return inputs, engine_id

    def _encode_items(
        self, inputs: ProcessedInputs
    ) -> tuple[dict[str, list[_Pieces]], dict[str, list[_Pieces | None]]]:
        data: dict[str, list[_Pieces]] = {}
        metadata: dict[str, list[_Pieces | None]] = {}
        for feature in inputs.features:
            key = (feature.modality, feature.hash)
            encoded = self.encoded.get(key)
            if encoded is None:
                fields = self._fields_of(feature.modality, feature.data)
                pixels = frozenset(feature.norm.pixel_keys) if feature.norm else _DEFAULT_PIXEL_KEYS
                encoded = (
                    encode_item(feature.data, fields, pixels),
                    encode_metadata(feature.data, fields, pixels),
                )
                self.encoded.put(key, encoded)
            data.setdefault(feature.modality, []).append(encoded[0])
            metadata.setdefault(feature.modality, []).append(encoded[1])
        return data, metadata

    def _fields_of(self, modality: str, data: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        key = (modality, frozenset(data))
        fields = self._fields.get(key)
        if fields is None:
            processor = self.processor
            fields = self._fields[key] = processor.model.get_mm_fields(processor.ctx, data)
        return fields

    async def _respond(self, answer: Any, endpoint: str) -> Response:
        begin = time.perf_counter()
        if isinstance(answer, dict) and answer.get("features"):
            pieces = _json_pieces(answer)
            self.metrics.observe(endpoint, "serialise", time.perf_counter() - begin)
            return _PiecesResponse(pieces)
        body = orjson.dumps(answer)
        self.metrics.observe(endpoint, "serialise", time.perf_counter() - begin)
        return Response(body, media_type="application/json")


class _PiecesResponse(Response):
    """A JSON body sent as the pieces it was made of (the items are never joined into one
    copy of the answer)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces
        super().__init__(b"")
        self.headers["content-length"] = str(sum(len(piece) for piece in pieces))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        last = len(self._pieces) - 1
        for index, piece in enumerate(self._pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": index < last})


def _json_pieces(answer: dict[str, Any]) -> list[bytes]:
    """``answer`` as pieces of JSON, its encoded items (base64 bytes) as pieces of their own.

    The items are base64 (nothing in them needs escaping), megabytes each: a JSON encoder would
    scan and copy every byte of them. They are serialised as markers instead (a nonce no
    request can know, so no echoed request field can pass for one) and placed between the
    pieces of the rest.
    """
    features = answer["features"]
    nonce = secrets.token_hex(16)
    items: list[_Pieces] = []

    def marked(values: list[_Pieces | None]) -> list[str | None]:
        out: list[str | None] = []
        for value in values:
            if value is None:
                out.append(None)
            else:
                out.append(f"{nonce}{len(items)}")
                items.append(value)
        return out

    spliced = dict(features)
    for key in ("kwargs_data", "mm_metadata"):
        if features.get(key):
            spliced[key] = {modality: marked(list(v)) for modality, v in features[key].items()}
    body = orjson.dumps({**answer, "features": spliced})
    if not items:
        return [body]
    # Split on the nonce itself, not a pattern: a pattern made of it would be compiled anew for
    # every request. Each piece after the first begins with its marker's item number.
    split = body.split(nonce.encode())
    pieces = split[:1]
    for piece in split[1:]:
        end = piece.index(b'"')
        pieces += items[int(piece[:end])]
        pieces.append(piece[end:])
    return pieces


def _json(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status_code=status, media_type="application/json")


def _chat_param(exc: ChatRequestError) -> str | None:
    if exc.field is not None:
        return exc.field
    if exc.message_index is None:
        return "messages"  # the conversation as a whole (the template refused it)
    param = f"messages[{exc.message_index}]"
    if exc.part_index is not None:
        param += f".content[{exc.part_index}]"
    return param


def _max_token_id(tokenizer: Any) -> int | None:
    """The largest token id the tokenizer has (None when it cannot say)."""
    try:
        return max(tokenizer.get_vocab().values())
    except (AttributeError, TypeError, ValueError):
        return None


def _template_fault(processor: Any, tokenizer: Any, *, with_tools: bool) -> str | None:
    """Why the model folder has no chat template for a chat (with tools or not), or None."""
    try:
        find_chat_template(processor, tokenizer, None, with_tools=with_tools)
    except ChatTemplateError as exc:
        return str(exc)
    return None


def create_app(processor: Processor, settings: ServeSettings) -> Starlette:
    """The render service for ``processor``; closing the app (its lifespan) closes it."""
    server = _Server(processor, settings)
    routes = [
        Route("/v1/chat/completions/render", server.chat, methods=["POST"]),
        Route("/v1/completions/render", server.completions, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=server.lifespan)
    app.state.server = server
    return app
