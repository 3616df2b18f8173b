"""The render service as an ASGI application (Starlette), around one :class:`~mmproc.Processor`.

Endpoints: ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render`` (vLLM's
render format, :mod:`mmproc.serve.protocol`), ``GET /health``, ``GET /v1/models``, ``GET
/metrics`` (Prometheus text, :mod:`mmproc.serve.metrics`).

What each request goes through, and what it may cost:

* its body is read up to ``max_body_bytes`` (413 over it; a ``Content-Length`` over it is refused
  before reading) and parsed (400 for JSON that is not an object of the right fields);
* it waits for one of ``max_concurrency`` render slots; with ``max_queue`` requests already
  waiting it is refused at once: 503 with ``Retry-After``;
* it is rendered within ``request_timeout_s`` (504 past it): the chat template, the media
  (decoded on the processor's IO pool, preprocessed on its workers, cached), and the answer —
  items in vLLM's ``kwargs_data`` (encoded once per item and kept in a byte-bounded LRU, so a
  repeated image is answered without encoding it again), or, with an engine, the request sent
  over mmproc's wire and answered once the engine acknowledged it (502 when it refused it or
  never acknowledged it).

Every refusal is OpenAI's error JSON; a bad chat input is a 400 naming the message and the part
(``param``: ``messages[1].content[0]``). No traceback ever reaches a client: an unexpected error
is a 500 saying only that, logged in full here. One bad request never affects another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mmproc.errors import ChatRequestError, MmprocError
from mmproc.fields import FieldSpec
from mmproc.processed import ProcessedInputs
from mmproc.processor import Processor
from mmproc.serve.engine_link import EngineLink, EngineRefused
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


@dataclass(frozen=True)
class ServeSettings:
    """How the server takes its requests (the ``mmproc serve`` options).

    ``served_model_names``
        the names a request's ``model`` may say (the first is what ``/v1/models`` lists first).
    ``max_model_len``
        the model's context, for the default ``max_tokens`` (None: no default).
    ``max_body_bytes``
        the largest request body (default 64 MiB).
    ``max_concurrency`` / ``max_queue``
        requests rendered at once (default 64), and waiting beyond them (default 256).
    ``request_timeout_s``
        the longest a request is rendered (default 60 s).
    ``trust_request_chat_template``
        accept a ``chat_template`` in requests (default no: it is code the server runs).
    ``engine``
        an ``ipc://`` or ``tcp://`` address: send every rendered request to the engine over
        mmproc's wire instead of answering its tensors.
    ``engine_ack_timeout_s`` / ``engine_max_attempts``
        how long the engine has to acknowledge a request before it is sent again, and how many
        sends before the HTTP request fails (502); default: the wire's.
    ``encoded_item_cache_bytes``
        bytes of encoded items kept for repeated media (default 1 GiB; 0: none).
    """

    served_model_names: tuple[str, ...]
    max_model_len: int | None = None
    max_body_bytes: int = 64 << 20
    max_concurrency: int = 64
    max_queue: int = 256
    request_timeout_s: float = 60.0
    trust_request_chat_template: bool = False
    engine: str | None = None
    engine_ack_timeout_s: float | None = None
    engine_max_attempts: int | None = None
    encoded_item_cache_bytes: int = 1 << 30


_Pieces = list[bytes]  # an encoded item: ASCII pieces whose concatenation is its base64


def _size(pieces: _Pieces | None) -> int:
    return sum(len(piece) for piece in pieces or ())


class _Busy(Exception):
    """Every render slot is taken and the queue is full."""


class _EncodedItems:
    """Items already encoded in vLLM's format, by hash: a byte-bounded LRU."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._items: OrderedDict[tuple[str, str], tuple[_Pieces, _Pieces | None]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

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
        self._waiting = 0
        self._fields: dict[tuple[str, frozenset[str]], Mapping[str, FieldSpec]] = {}

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        settings = self.settings
        if settings.engine is not None:
            options: dict[str, Any] = {}
            if settings.engine_ack_timeout_s is not None:
                options["ack_timeout"] = settings.engine_ack_timeout_s
            if settings.engine_max_attempts is not None:
                options["max_attempts"] = settings.engine_max_attempts
            self.engine = EngineLink(settings.engine, **options)
            self.metrics.watch_engine(self.engine.sender)
        try:
            yield
        finally:
            # After uvicorn has drained the requests in flight (SIGTERM, Ctrl-C).
            if self.engine is not None:
                self.engine.close()
            self.processor.close()

    # --- admission -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        if self._slots.locked() and self._waiting >= self.settings.max_queue:
            raise _Busy
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._slots.release()

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

    async def _handle(self, request: Request, endpoint: str, render: Any) -> Response:
        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            try:
                body = await self._body(request)
                async with self.admitted():
                    self.metrics.observe(endpoint, "queue", time.perf_counter() - start)
                    answer = await asyncio.wait_for(
                        render(body, request), self.settings.request_timeout_s
                    )
            except BadRequest as exc:
                return self._error(endpoint, exc.kind, str(exc), exc.status, exc.param)
            except _Busy:
                response = self._error(
                    endpoint, "ServiceUnavailableError", "the server is busy: retry later", 503
                )
                response.headers["Retry-After"] = "1"
                return response
            except TimeoutError:
                return self._error(
                    endpoint,
                    "TimeoutError",
                    f"the request took longer than {self.settings.request_timeout_s:g} s",
                    504,
                )
            except EngineRefused as exc:
                return self._error(endpoint, "EngineError", str(exc), 502)
            except ChatRequestError as exc:
                return self._error(endpoint, "BadRequestError", str(exc), 400, _chat_param(exc))
            except MmprocError as exc:
                return self._error(endpoint, "BadRequestError", str(exc), 400)
            except Exception:
                logger.exception("an unexpected error while rendering a %s request", endpoint)
                return self._error(endpoint, "InternalServerError", "internal server error", 500)
            self.metrics.requests.labels(endpoint, "200").inc()
            self.metrics.observe(endpoint, "total", time.perf_counter() - start)
            return answer
        finally:
            self.metrics.in_flight.dec()

    def _error(
        self, endpoint: str, kind: str, message: str, status: int, param: Any = None
    ) -> Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.errors.labels(endpoint, kind).inc()
        return _json(error_body(message, kind, status, param), status=status)

    async def _body(self, request: Request) -> Any:
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
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(
                    f"the request body is over {limit:,} bytes", status=413, kind="RequestTooLarge"
                )
            chunks.append(chunk)
        try:
            return orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None

    # --- rendering -------------------------------------------------------------------------

    async def _render_chat(self, body: Any, request: Request) -> Response:
        settings = self.settings
        chat = parse_chat(
            body,
            served=settings.served_model_names,
            header_request_id=request.headers.get("x-request-id"),
            trust_chat_template=settings.trust_request_chat_template,
        )
        begin = time.perf_counter()
        inputs = await self.processor.process_chat_async(chat.messages, **chat.chat_kwargs)
        self.metrics.observe("chat", "render", time.perf_counter() - begin)
        features, engine_id = await self._deliver(
            inputs, chat.request_id, chat.sampling, chat.with_tensors, "chat"
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

    async def _render_completions(self, body: Any, request: Request) -> Response:
        settings = self.settings
        completion = parse_completion(
            body,
            served=settings.served_model_names,
            header_request_id=request.headers.get("x-request-id"),
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
            _, engine_id = await self._deliver(
                inputs, request_id, completion.sampling, False, "completions"
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
        request_id: str,
        sampling: Mapping[str, Any],
        with_tensors: bool,
        endpoint: str,
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The answer's ``features``, and the engine request id on the native path (where the
        request went to the engine and the answer carries no tensors)."""
        engine_id = None
        if self.engine is not None:
            begin = time.perf_counter()
            await self.engine.send(
                inputs.to_engine_request(request_id, dict(sampling)),
                timeout=self.settings.request_timeout_s,
            )
            self.metrics.observe(endpoint, "engine", time.perf_counter() - begin)
            engine_id, with_tensors = request_id, False
        if not inputs.features:
            return None, engine_id
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
        return features, engine_id

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
    # re.split alternates the text between markers and the markers' item numbers.
    split: list[bytes] = re.split(rb"(?<=\")" + nonce.encode() + rb"(\d+)(?=\")", body)
    pieces = split[:1]
    for i in range(1, len(split), 2):
        pieces += items[int(split[i])]
        pieces.append(split[i + 1])
    return pieces


def _json(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status_code=status, media_type="application/json")


def _chat_param(exc: ChatRequestError) -> str | None:
    if exc.message_index is None:
        return "messages"
    param = f"messages[{exc.message_index}]"
    if exc.part_index is not None:
        param += f".content[{exc.part_index}]"
    return param


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
