"""``mmproc serve``: a real server on 127.0.0.1 (uvicorn on a free port) and a real HTTP client.

The render endpoints in vLLM's format, the native path to a real ``RequestReceiver``, every
refusal the server makes, concurrent clients, and shutdown by SIGTERM.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import mmproc
import msgpack
import numpy as np
import orjson
import pytest
import torch
import uvicorn
from _tiny_models import TinyQwenImageModel
from mmproc import hookimpl
from mmproc.errors import WorkerProcessError
from mmproc.fields import FlatField
from mmproc.serve import ServeSettings, allocator, create_app
from mmproc.testing import noise_image
from mmproc.wire import RequestReceiver

MODEL = "tiny-qwen"
HELLO = [{"role": "user", "content": "Hello"}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Served:
    """A server running in a thread of this process, and a client for it."""

    def __init__(self, processor: mmproc.Processor, settings: ServeSettings) -> None:
        self.port = free_port()
        self.app = create_app(processor, settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def chat(self, messages: Any, **body: Any) -> httpx.Response:
        return self.client.post(
            "/v1/chat/completions/render", json={"model": MODEL, "messages": messages, **body}
        )

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def serve(qwen_folder: Path) -> Iterator[Callable[..., Served]]:
    """``serve(**settings)``: a server on the qwen_vl demo folder (stopped after the module)."""
    running: list[Served] = []

    def start(
        folder: Path = qwen_folder,
        registry: Any = None,
        options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> Served:
        options = {"warm_up": True, **(options or {})}
        if registry is not None:
            options["registry"] = registry
        processor = mmproc.get_processor(folder, **options)
        served = Served(processor, ServeSettings(served_model_names=(MODEL,), **settings))
        running.append(served)
        return served

    yield start
    for served in running:
        served.stop()


@pytest.fixture(scope="module")
def server(serve: Callable[..., Served]) -> Served:
    return serve(max_model_len=4096)


def jpeg_url(seed: int, size: tuple[int, int] = (120, 90)) -> str:
    buffer = io.BytesIO()
    noise_image(*size, seed=seed).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_chat(seed: int, text: str = "What is this?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": jpeg_url(seed)}},
                {"type": "text", "text": text},
            ],
        }
    ]


def image_part(seed: int, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": jpeg_url(seed)}, **extra}


def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def partial_request(port: int, declared: int, sent: bytes) -> socket.socket:
    """A chat render request on a socket of its own that declares a body of ``declared`` bytes
    and sends only ``sent`` of it (the socket is left open: the rest never comes)."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(
        b"POST /v1/chat/completions/render HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {declared}\r\n\r\n".encode()
        + sent
    )
    return connection


def status_of(connection: socket.socket) -> int:
    """The status of the answer that arrives on ``connection`` (within its timeout)."""
    head = b""
    while b"\r\n" not in head:
        chunk = connection.recv(4096)
        assert chunk, "the server closed the connection without answering"
        head += chunk
    return int(head.split(b" ", 2)[1])


def decode_item(encoded: str) -> dict[str, Any]:
    """One kwargs_data item as vLLM's mm_serde lays it out: key -> (tensor, [kind, options])."""
    raw = msgpack.unpackb(
        base64.b64decode(encoded), ext_hook=lambda code, data: (code, data), strict_map_key=False
    )
    out = {}
    for key, entry in raw.items():
        dtype, shape, (code, data) = entry["data"]
        assert code == 3  # vLLM's raw-view ext type
        array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        out[key] = (torch.from_numpy(array.copy()), entry["field"])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_an_item_encoded_in_pieces_is_the_base64_of_the_whole(seed: int) -> None:
    from mmproc.serve.vllm_items import _base64_pieces

    rng = np.random.default_rng(seed)
    # Small and big parts (big ones are encoded from their own memory), lengths not multiples
    # of 3, a big part first and last.
    lengths = [int(n) for n in rng.choice([0, 1, 2, 5, 70_000, 70_001, 200_003], size=6)]
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    parts[1] = memoryview(np.frombuffer(parts[1], dtype=np.uint8).copy()).cast("B")
    pieces = _base64_pieces(parts)
    assert b"".join(pieces) == base64.b64encode(b"".join(bytes(p) for p in parts))
    assert all(b"=" not in piece for piece in pieces[:-1])


def test_an_answer_in_pieces_is_the_json_of_the_answer_with_its_items_joined() -> None:
    from mmproc.serve.app import _json_pieces

    items = {"image": [[b"QUJD", b"REVG"], [b"R0g="]], "audio": [[b"SUpL"]]}
    metadata = {"image": [None, [b"e30="]], "audio": [None]}
    answer = {
        "request_id": '"1" and "12" echoed back',  # quotes and digits as markers have them
        "token_ids": [1, 2, 3],
        "features": {
            "mm_hashes": {"image": ["a", "b"]},
            "kwargs_data": items,
            "mm_metadata": metadata,
        },
    }
    pieces = _json_pieces(answer)
    assert len(pieces) > 1  # the items are pieces of their own, never joined into a copy
    joined = {m: ["".join(p.decode() for p in v) for v in vs] for m, vs in items.items()}
    meta = {
        m: [None if v is None else b"".join(v).decode() for v in vs] for m, vs in metadata.items()
    }
    expected = {
        **answer,
        "features": {**answer["features"], "kwargs_data": joined, "mm_metadata": meta},
    }
    assert orjson.loads(b"".join(pieces)) == expected


def test_an_answer_without_items_is_one_piece() -> None:
    from mmproc.serve.app import _json_pieces

    answer = {"request_id": "r", "features": {"mm_hashes": {"image": ["a"]}, "kwargs_data": None}}
    assert _json_pieces(answer) == [orjson.dumps(answer)]


# --- the render endpoints -----------------------------------------------------------------------


def test_an_item_is_kept_encoded_from_its_second_request_on(server: Served) -> None:
    encoded = server.app.state.server.encoded
    chat = image_chat(seed=4242)
    held = len(encoded)
    first = server.chat(chat)
    assert first.status_code == 200
    assert len(encoded) == held  # a first sighting is encoded, not kept
    second = server.chat(chat)
    assert len(encoded) == held + 1
    third = server.chat(chat)  # answered from the kept encoding
    assert first.json()["features"] == second.json()["features"] == third.json()["features"]


def test_each_admitted_request_asks_the_heap_reserve_for_room(
    server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    class CountingReserve:
        calls = 0

        def make_room(self) -> None:
            self.calls += 1

    reserve = CountingReserve()
    monkeypatch.setattr(allocator, "_active", reserve)
    assert server.chat(image_chat(seed=4343)).status_code == 200
    assert server.client.get("/health").status_code == 200  # admits nothing
    assert reserve.calls == 1


def test_the_keys_of_items_seen_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmproc.serve.app import _EncodedItems

    monkeypatch.setattr(_EncodedItems, "_NOTED_KEYS", 2)
    items = _EncodedItems(max_bytes=1 << 20)
    value = ([b"QUJD"], None)
    for name in ("a", "b", "c"):  # "a", the oldest noted, is forgotten
        items.put(("image", name), value)
    items.put(("image", "a"), value)
    items.put(("image", "c"), value)
    assert items.get(("image", "a")) is None  # noted again, as if new
    assert items.get(("image", "c")) == value
    assert len(items) == 1


def test_a_chat_render_answers_what_process_chat_gives_in_vllms_format(
    server: Served, qwen_folder: Path
) -> None:
    messages = image_chat(1)
    response = server.chat(messages, request_id="abc", max_tokens=16, temperature=0.5)
    assert response.status_code == 200, response.text
    answer = response.json()
    with mmproc.get_processor(qwen_folder) as processor:
        expected = processor.process_chat(messages, add_special_tokens=False)
    assert answer["request_id"] == "chatcmpl-abc"
    assert answer["token_ids"] == expected.prompt_token_ids
    features = answer["features"]
    [feature] = expected.features
    assert features["mm_placeholders"] == {
        "image": [{"offset": feature.placeholder.offset, "length": feature.placeholder.length}]
    }
    assert features["mm_hashes"] == {"image": [feature.hash]}
    item = decode_item(features["kwargs_data"]["image"][0])
    pixels, pixel_field = item["pixel_values"]
    assert torch.equal(pixels, feature.data["pixel_values"])
    assert pixel_field == [
        "flat",
        {"keep_on_cpu": False, "slices": [[[0, pixels.shape[0], None]]], "dim": 0},
    ]
    grid, grid_field = item["image_grid_thw"]
    assert torch.equal(grid, feature.data["image_grid_thw"])
    assert grid_field == ["batched", {"keep_on_cpu": True}]
    assert set(decode_item(features["mm_metadata"]["image"][0])) == {"image_grid_thw"}
    assert answer["sampling_params"]["max_tokens"] == 16
    assert answer["sampling_params"]["temperature"] == 0.5
    without = server.chat(messages, mm_payload="none").json()
    assert without["features"]["kwargs_data"] is None
    assert without["sampling_params"]["max_tokens"] == 4096 - len(without["token_ids"])


def test_a_completions_render_answers_one_request_per_prompt(server: Served) -> None:
    response = server.client.post(
        "/v1/completions/render",
        json={"model": MODEL, "prompt": ["Hello there", [1, 2, 3]], "request_id": "x"},
    )
    assert response.status_code == 200, response.text
    first, second = response.json()
    assert (first["request_id"], second["request_id"]) == ("cmpl-x-0", "cmpl-x-1")
    assert second["token_ids"] == [1, 2, 3]
    assert first["features"] is None and first["token_ids"]


def test_health_models_and_metrics(server: Served) -> None:
    assert server.client.get("/health").status_code == 200
    models = server.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    server.chat(image_chat(2))
    metrics = server.client.get("/metrics").text
    assert 'mmproc_requests_total{endpoint="chat",status="200"}' in metrics
    assert 'mmproc_request_seconds_count{endpoint="chat",stage="render"}' in metrics
    assert "mmproc_cache_misses_total" in metrics and "mmproc_requests_in_flight" in metrics


def test_concurrent_clients_get_what_sequential_ones_get(server: Served) -> None:
    chats = [image_chat(10 + i % 4, f"question {i}") for i in range(12)]
    sequential = [server.chat(chat).json() for chat in chats]
    answers: list[Any] = [None] * len(chats)

    def ask(index: int) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
            body = {"model": MODEL, "messages": chats[index]}
            answers[index] = client.post("/v1/chat/completions/render", json=body).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(chats))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for concurrent, alone in zip(answers, sequential):
        assert concurrent["token_ids"] == alone["token_ids"]
        assert concurrent["features"]["kwargs_data"] == alone["features"]["kwargs_data"]


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"model": "other", "messages": []}, 404, "model", "does not exist"),
        ({"model": MODEL}, 400, "messages", "has no messages"),
        ({"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0]", "no role"),
        (
            {
                "model": MODEL,
                "messages": [*image_chat(3), {"role": "user", "content": [{"type": "x"}]}],
            },
            400,
            "messages[1].content[0]",
            "unknown content part type",
        ),
        (
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            }
                        ],
                    }
                ],
            },
            400,
            "messages[0].content[0]",
            "cannot identify the image data",
        ),
        (
            {"model": MODEL, "messages": [], "chat_template": "{{ 1 }}"},
            400,
            "chat_template",
            "refused",
        ),
        ({"model": MODEL, "messages": [], "max_tokens": -1}, 400, "max_tokens", "positive"),
        (
            {"model": MODEL, "messages": HELLO, "tools": [{"type": "function"}, 7]},
            400,
            "tools[1]",
            "entry 1 is int",
        ),
        ({"model": MODEL, "messages": HELLO, "documents": "notes"}, 400, "documents", "list of"),
        (
            {
                "model": MODEL,
                "messages": HELLO,
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            400,
            "continue_final_message",
            "cannot both be set",
        ),
        (
            {"model": MODEL, "messages": [{**HELLO[0], "tool_calls": nested(200)}]},
            400,
            "messages[0]",
            "nested deeper than 64 levels",
        ),
        (
            {"model": MODEL, "messages": HELLO, "tools": [{"function": nested(200)}]},
            400,
            "tools[0]",
            "nested deeper than 64 levels",
        ),
        (
            {"model": MODEL, "messages": HELLO, "chat_template_kwargs": {"a": nested(200)}},
            400,
            "chat_template_kwargs",
            "nested deeper than 64 levels",
        ),
        # Fields echoed in the answer, which JSON encoders refuse past 255 levels.
        ({"model": MODEL, "messages": HELLO, "temperature": nested(300)}, 400, "temperature", "64"),
        (
            {"model": MODEL, "messages": HELLO, "kv_transfer_params": {"a": nested(300)}},
            400,
            "kv_transfer_params",
            "nested deeper than 64 levels",
        ),
    ],
)
def test_bad_requests_are_openai_errors_naming_the_field(
    server: Served, body: dict[str, Any], status: int, param: str, message: str
) -> None:
    response = server.client.post("/v1/chat/completions/render", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (status, param)
    assert message in error["message"]
    assert "Traceback" not in response.text
    assert server.chat(image_chat(4)).status_code == 200  # and the next request is served


def test_a_body_that_is_not_json_or_too_large_is_refused(serve: Callable[..., Served]) -> None:
    small = serve(max_body_bytes=4096)
    path = "/v1/chat/completions/render"
    assert small.client.post(path, content=b"{nope").status_code == 400
    response = small.client.post(path, content=b"[1]", headers={"Content-Type": "text/plain"})
    assert response.status_code == 400 and "Unsupported Media Type" in response.text
    big = small.chat(image_chat(5))
    assert big.status_code == 413 and big.json()["error"]["type"] == "RequestTooLarge"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the size is counted while reading
        yield b'{"messages": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    streamed = small.client.post(
        path, content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413


def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(
    serve: Callable[..., Served],
) -> None:
    small = serve(max_body_bytes=4096)
    connection = partial_request(small.port, 10 << 20, b'{"messages": "')
    with connection:
        assert status_of(connection) == 413  # the other 10 MiB never came


def test_requests_whose_bodies_are_still_arriving_hold_their_places_in_the_queue(
    serve: Callable[..., Served],
) -> None:
    full = serve(max_concurrency=1, max_queue=1, request_timeout_s=30)
    waiting = [partial_request(full.port, 1000, b'{"messages": [') for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while "mmproc_requests_in_flight 2.0" not in full.client.get("/metrics").text:
            assert time.monotonic() < deadline, "the two requests were never in flight"
            time.sleep(0.01)
        refused = full.chat(image_chat(6))
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    finally:
        for connection in waiting:
            connection.close()
    deadline = time.monotonic() + 10
    while (answer := full.chat(image_chat(6))).status_code == 503:  # their places come back
        assert time.monotonic() < deadline, "the places of the requests that went away stayed"
        time.sleep(0.05)
    assert answer.status_code == 200


def test_a_body_that_does_not_arrive_within_the_request_timeout_is_a_408(
    serve: Callable[..., Served],
) -> None:
    impatient = serve(request_timeout_s=1.0)
    with partial_request(impatient.port, 1000, b'{"messages": [') as connection:
        assert status_of(connection) == 408


def test_a_client_that_goes_away_while_sending_its_body_logs_no_error(
    serve: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    server = serve()
    with caplog.at_level(logging.INFO, logger="mmproc.serve"):
        partial_request(server.port, 1000, b'{"messages": [').close()
        deadline = time.monotonic() + 10
        metrics = ""
        while 'kind="ClientDisconnect"' not in metrics:
            assert time.monotonic() < deadline, "the server never saw the client go away"
            time.sleep(0.01)
            metrics = server.client.get("/metrics").text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert server.chat(image_chat(7)).status_code == 200


def test_chat_text_over_max_prompt_chars_is_refused_before_it_is_rendered(
    serve: Callable[..., Served],
) -> None:
    short = serve(options={"max_prompt_chars": 1000})
    response = short.chat([{"role": "user", "content": "word " * 400}])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "max_prompt_chars" in error["message"]
    assert short.chat([{"role": "user", "content": "word " * 100}]).status_code == 200
    # Media parts are not text: a picture's data URL counts for nothing.
    assert short.chat(image_chat(8)).status_code == 200


def test_a_completion_prompt_over_max_prompt_chars_is_refused_before_it_is_tokenised(
    serve: Callable[..., Served],
) -> None:
    short = serve(options={"max_prompt_chars": 1000})
    body = {"model": MODEL, "prompt": ["fine", "word " * 400]}
    response = short.client.post("/v1/completions/render", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt[1]" and "max_prompt_chars" in error["message"]


def test_token_ids_the_vocabulary_does_not_have_are_refused(server: Served) -> None:
    vocabulary = len(server.app.state.server.processor.hf_processor.tokenizer)
    path = "/v1/completions/render"
    refused = server.client.post(path, json={"model": MODEL, "prompt": [1, vocabulary + 10]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "prompt"
    assert "vocabulary" in refused.json()["error"]["message"]
    assert server.client.post(path, json={"model": MODEL, "prompt": [1, 2]}).status_code == 200


# --- item ids -----------------------------------------------------------------------------------


def picture_chat(seed: int, uuid: str | None = None) -> list[dict[str, Any]]:
    part = image_part(seed) if uuid is None else image_part(seed, uuid=uuid)
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]


def test_by_default_a_parts_uuid_is_ignored_so_one_client_cannot_fetch_anothers_item(
    server: Served, qwen_folder: Path
) -> None:
    first = server.chat(picture_chat(50, uuid="shared")).json()
    second = server.chat(picture_chat(51, uuid="shared")).json()
    hashes = [answer["features"]["mm_hashes"]["image"][0] for answer in (first, second)]
    assert hashes[0] != hashes[1] and "shared" not in hashes
    with mmproc.get_processor(qwen_folder) as processor:
        for seed, answer in zip((50, 51), (first, second)):
            [expected] = processor.process_chat(picture_chat(seed)).features
            pixels, _ = decode_item(answer["features"]["kwargs_data"]["image"][0])["pixel_values"]
            assert torch.equal(pixels, expected.data["pixel_values"])
            assert answer["features"]["mm_hashes"]["image"] == [expected.hash]


def test_by_default_a_part_named_by_its_uuid_alone_is_refused(server: Served) -> None:
    by_id = [{"role": "user", "content": [{"type": "image_url", "uuid": "shared"}]}]
    response = server.chat(by_id)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[0]" and "--trust-request-ids" in error["message"]


def test_with_trusted_request_ids_a_parts_uuid_names_its_item(
    serve: Callable[..., Served],
) -> None:
    trusting = serve(trust_request_ids=True)
    first = trusting.chat(picture_chat(52, uuid="tenant-a/1")).json()
    assert first["features"]["mm_hashes"]["image"] == ["tenant-a/1"]
    by_id = [{"role": "user", "content": [{"type": "image_url", "uuid": "tenant-a/1"}]}]
    again = trusting.chat(by_id).json()
    assert again["features"]["mm_hashes"]["image"] == ["tenant-a/1"]
    assert again["features"]["kwargs_data"] == first["features"]["kwargs_data"]
    # The id stands for the item, whatever data comes with it: why only one tenant may use it.
    other = trusting.chat(picture_chat(53, uuid="tenant-a/1")).json()
    assert other["features"]["kwargs_data"] == first["features"]["kwargs_data"]


# --- faults on the server's side ----------------------------------------------------------------


class BrokenFields(TinyQwenImageModel):
    """Forgets to say how image_grid_thw splits (a plugin bug)."""

    @hookimpl
    def get_mm_fields(self, outputs: Any) -> Any:
        return {"pixel_values": FlatField.from_grid("image", "image_grid_thw")}


class LosesItsWorker(TinyQwenImageModel):
    """Its worker process dies under every request."""

    @hookimpl
    def process_mm_data(self) -> Any:
        raise WorkerProcessError("worker process 0 died (exit code -9)")


def test_a_fault_of_the_servers_plugin_is_a_500_logged_with_its_traceback(
    serve: Callable[..., Served],
    folder_for: Callable[[str], Path],
    serving: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = serve(
        folder_for("BrokenFieldsForTest"),
        registry=serving({"BrokenFieldsForTest": BrokenFields}),
        options={"warm_up": False},
    )
    with caplog.at_level(logging.ERROR, logger="mmproc.serve"):
        response = broken.chat(image_chat(60))
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "InternalServerError" and "image_grid_thw" not in error["message"]
    [record] = [r for r in caplog.records if r.name == "mmproc.serve.app"]
    assert record.exc_info is not None and "image_grid_thw" in str(record.exc_info[1])
    assert broken.chat(HELLO).status_code == 200  # a chat without media is served


def test_a_worker_process_lost_under_a_request_is_a_503_with_retry_after(
    serve: Callable[..., Served], folder_for: Callable[[str], Path], serving: Any
) -> None:
    losing = serve(
        folder_for("LosesItsWorkerForTest"),
        registry=serving({"LosesItsWorkerForTest": LosesItsWorker}),
        options={"warm_up": False},
    )
    response = losing.chat(image_chat(61))
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert "died" not in response.json()["error"]["message"]


def test_a_model_folder_without_a_chat_template_answers_chats_with_a_500(
    serve: Callable[..., Served], qwen_folder: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "no-template"
    shutil.copytree(qwen_folder, folder)
    (folder / "chat_template.json").unlink()
    assert "chat_template" not in (folder / "tokenizer_config.json").read_text()
    untemplated = serve(folder)
    response = untemplated.chat(HELLO)
    assert response.status_code == 500
    assert "no chat template" in response.json()["error"]["message"]
    body = {"model": MODEL, "prompt": "Hello"}
    assert untemplated.client.post("/v1/completions/render", json=body).status_code == 200


class Slow(TinyQwenImageModel):
    """Holds every computation until the test releases it."""

    gate = threading.Event()

    @hookimpl
    def process_mm_data(self):
        assert Slow.gate.wait(30), "the test never released the gate"
        return None


def test_a_full_queue_is_a_503_with_retry_after_and_a_slow_request_a_504(
    serve: Callable[..., Served], folder_for: Callable[[str], Path], serving: Any
) -> None:
    registry = serving({"SlowForTest": Slow})
    Slow.gate.clear()
    busy = serve(
        folder_for("SlowForTest"),
        registry=registry,
        max_concurrency=1,
        max_queue=1,
        request_timeout_s=1.5,
    )
    outcomes: dict[int, int] = {}

    def ask(index: int) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{busy.port}", timeout=30) as client:
            body = {"model": MODEL, "messages": image_chat(20 + index)}
            outcomes[index] = client.post("/v1/chat/completions/render", json=body).status_code

    first = threading.Thread(target=ask, args=(0,))
    first.start()
    time.sleep(0.3)  # the first holds the one slot
    second = threading.Thread(target=ask, args=(1,))
    second.start()
    time.sleep(0.3)  # the second waits in the queue of one
    refused = busy.chat(image_chat(22))
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    first.join(30)
    second.join(30)
    assert outcomes[0] == 504  # 1.5 s, and the gate still closed
    Slow.gate.set()
    assert busy.chat(image_chat(23)).status_code == 200


# --- the native path ----------------------------------------------------------------------------


def ask_engine(
    native: Served, receiver: RequestReceiver, messages: Any, **body: Any
) -> tuple[httpx.Response, Any]:
    """One native chat request, and what the engine behind ``receiver`` took of it."""
    received: list[Any] = []
    reader = threading.Thread(target=lambda: received.append(receiver.recv(timeout=30)))
    reader.start()
    response = native.chat(messages, **body)
    reader.join(30)
    assert response.status_code == 200, response.text
    [request] = received
    return response, request


def assert_same_item(got: Any, expected: Any) -> None:
    """The engine took ``got`` (a request) with the first item's tensors of ``expected``."""
    for name, tensor in expected.features[0].data.items():
        assert torch.equal(got.features[0].data[name], tensor)


def test_the_native_path_sends_the_request_to_the_engine_and_answers_without_tensors(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    with RequestReceiver(address, bind=True) as receiver:
        native = serve(engine=address)
        response, request = ask_engine(
            native, receiver, image_chat(30), request_id="n1", max_tokens=8
        )
        answer = response.json()
        assert answer["request_id"] == "chatcmpl-n1"
        assert answer["engine_request_id"] == request.request_id
        assert request.request_id.startswith("chatcmpl-n1-")
        assert answer["features"]["kwargs_data"] is None
        assert list(request.prompt_token_ids) == answer["token_ids"]
        assert request.params["max_tokens"] == 8
        [feature] = request.features
        assert feature.hash == answer["features"]["mm_hashes"]["image"][0]
        assert feature.data["pixel_values"].dtype == torch.uint8
        metrics = native.client.get("/metrics").text
        assert "mmproc_engine_acknowledged_total 1.0" in metrics
        assert "mmproc_engine_items_in_full_total 1.0" in metrics
        assert "mmproc_engine_unsettled 0.0" in metrics


def test_once_the_engine_holds_an_item_the_server_keeps_only_a_stand_in_and_refers_to_it(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    chat = image_chat(40)
    with RequestReceiver(address, bind=True) as receiver:
        native = serve(engine=address)
        _, first = ask_engine(native, receiver, chat)
        stats = native.app.state.server.processor.cache.stats()
        assert (stats.entries, stats.stand_ins) == (1, 1)
        assert stats.nbytes < first.features[0].data["pixel_values"].nbytes
        answer, again = ask_engine(native, receiver, chat)
        assert answer.json()["features"]["mm_hashes"]["image"] == [first.features[0].hash]
        assert list(again.prompt_token_ids) == list(first.prompt_token_ids)
        # The engine filled the reference in with the tensors it took the first time.
        assert_same_item(again, first)
        metrics = native.client.get("/metrics").text
        assert "mmproc_engine_items_by_reference_total 1.0" in metrics
        assert "mmproc_cache_stand_ins 1.0" in metrics


def test_a_server_told_its_engine_keeps_no_items_sends_each_in_full_and_keeps_them_whole(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    chat = image_chat(42)
    # The receiver would keep them: only the setting stops references and stand-ins.
    with RequestReceiver(address, bind=True) as receiver:
        native = serve(engine=address, engine_item_cache_bytes=0)
        for _ in range(2):
            _, taken = ask_engine(native, receiver, chat)
            assert taken.features[0].data["pixel_values"].dtype == torch.uint8
        stats = native.app.state.server.processor.cache.stats()
        assert (stats.entries, stats.stand_ins, stats.hits) == (1, 0, 1)
        assert receiver.stats.items_in_full == 2 and receiver.stats.items_by_reference == 0


def test_an_engine_restarted_empty_gets_a_stand_in_s_item_in_full_computed_again(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    chat = image_chat(41)
    with RequestReceiver(address, bind=True) as receiver:
        native = serve(engine=address)
        _, first = ask_engine(native, receiver, chat)
    assert native.app.state.server.processor.cache.stats().stand_ins == 1
    with RequestReceiver(address, bind=True) as restarted:  # empty: it holds nothing
        answer, again = ask_engine(native, restarted, chat)
    assert answer.json()["engine_request_id"] == again.request_id
    assert_same_item(again, first)
    assert restarted.stats.items_in_full == 1
    metrics = native.client.get("/metrics").text
    assert 'mmproc_stand_in_misses_total{endpoint="chat"} 1.0' in metrics


def test_two_requests_in_flight_under_one_request_id_are_both_acknowledged(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    with RequestReceiver(address, bind=True, auto_ack=False) as receiver:
        native = serve(engine=address, request_timeout_s=10)
        answers: dict[int, httpx.Response] = {}

        def ask(index: int) -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{native.port}", timeout=30) as client:
                body = {"model": MODEL, "messages": image_chat(32 + index), "request_id": "same"}
                answers[index] = client.post("/v1/chat/completions/render", json=body)

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for asker in askers:
            asker.start()
        # Both are in flight at once: neither is acknowledged before the engine has both.
        deliveries = [receiver.recv_delivery(timeout=30) for _ in range(2)]
        for delivery in deliveries:
            assert delivery is not None
            receiver.ack(delivery)
        for asker in askers:
            asker.join(30)
    assert [answers[i].status_code for i in range(2)] == [200, 200]
    engine_ids = {answers[i].json()["engine_request_id"] for i in range(2)}
    assert engine_ids == {d.request.request_id for d in deliveries if d is not None}
    assert len(engine_ids) == 2
    assert all(answers[i].json()["request_id"] == "chatcmpl-same" for i in range(2))


def test_a_request_the_engine_never_acknowledges_is_an_error_not_a_success(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    import zmq

    # An engine that is there (so the request can be sent) but never acknowledges it.
    address = f"ipc://{tmp_path}/silent.sock"
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.bind(address)
    try:
        native = serve(engine=address, engine_ack_timeout_s=0.2, engine_max_attempts=3)
        response = native.chat(image_chat(31))
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "EngineError" and "chatcmpl-" in error["message"]
        assert "3" in error["message"]  # how often it was sent
    finally:
        silent.close(0)
        context.term()


# --- the command and shutdown -------------------------------------------------------------------


def start_command(tmp: Path, *options: str) -> tuple[subprocess.Popen[bytes], int]:
    """``mmproc serve --model demo:qwen2-vl`` in a process of its own, its temporary files in
    ``tmp``, once it answers ``/health``; its output in ``tmp/output.txt``."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    command = [sys.executable, "-m", "mmproc.cli", "serve", "--model", "demo:qwen2-vl"]
    with open(tmp / "output.txt", "wb") as output:
        server = subprocess.Popen(
            [*command, "--port", str(port), *options],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        deadline = time.monotonic() + 120
        while True:
            try:
                if client.get("/health").status_code == 200:
                    return server, port
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise AssertionError("did not start: " + (tmp / "output.txt").read_text()[-2000:])
            time.sleep(0.2)


@pytest.fixture(scope="module")
def command(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The port of ``mmproc serve`` with one render slot and a queue of one."""
    server, port = start_command(
        tmp_path_factory.mktemp("command"), "--max-concurrency", "1", "--max-queue", "1"
    )
    yield port
    server.kill()
    server.wait(30)


@pytest.mark.parametrize("option", ["encoded-item-cache-bytes", "engine-item-cache-bytes"])
def test_the_command_takes_an_item_cache_size_with_a_unit(option: str) -> None:
    import argparse

    from mmproc.serve.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    name = option.replace("-", "_")
    assert getattr(parser.parse_args([]), name) is None  # the settings' default
    parsed = parser.parse_args([f"--{option}", "512MiB"])
    assert getattr(parsed, name) == 512 << 20
    with pytest.raises(SystemExit):
        parser.parse_args([f"--{option}", "lots"])


def test_the_command_takes_a_heap_reserve_below_mallocs_mmap_threshold() -> None:
    import argparse

    from mmproc.serve.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).heap_reserve_bytes is None  # the allocator's default
    assert parser.parse_args(["--heap-reserve-bytes", "8MiB"]).heap_reserve_bytes == 8 << 20
    assert parser.parse_args(["--heap-reserve-bytes", "0"]).heap_reserve_bytes == 0  # off
    with pytest.raises(SystemExit):
        parser.parse_args(["--heap-reserve-bytes", "32MiB"])  # malloc would map it on its own


def test_the_command_takes_at_most_64_items_of_a_modality_per_request(command: int) -> None:
    tiny = io.BytesIO()
    noise_image(8, 8).save(tiny, "PNG")
    url = "data:image/png;base64," + base64.b64encode(tiny.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 65
    with httpx.Client(base_url=f"http://127.0.0.1:{command}", timeout=60) as client:
        body = {"messages": [{"role": "user", "content": parts}]}
        response = client.post("/v1/chat/completions/render", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[64]"
    assert "more than 64 image items" in error["message"]
    assert "max_items_per_request" in error["message"]


def test_the_command_refuses_connections_beyond_what_it_admits(command: int) -> None:
    limit = ServeSettings(served_model_names=(MODEL,), max_concurrency=1, max_queue=1)
    idle = [
        socket.create_connection(("127.0.0.1", command), timeout=10)
        for _ in range(limit.connection_limit)
    ]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{command}", timeout=60) as client:
            deadline = time.monotonic() + 10
            while client.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "it took more connections than it admits"
                time.sleep(0.05)
    finally:
        for connection in idle:
            connection.close()
    with httpx.Client(base_url=f"http://127.0.0.1:{command}", timeout=60) as client:
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200:  # the connections are gone
            assert time.monotonic() < deadline, "the closed connections still counted"
            time.sleep(0.05)


def test_sigterm_drains_the_request_in_flight_and_exits_0_leaving_no_files(
    tmp_path: Path,
) -> None:
    server, port = start_command(tmp_path)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            # A big picture, so that the request is still being rendered when the signal comes.
            big = [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": jpeg_url(40, (2400, 1800))}}
                    ],
                }
            ]
            answers: list[httpx.Response] = []
            request = threading.Thread(
                target=lambda: answers.append(
                    client.post("/v1/chat/completions/render", json={"messages": big})
                )
            )
            request.start()
            while "mmproc_requests_in_flight 1.0" not in client.get("/metrics").text:
                assert request.is_alive(), "the request ended before the signal"
                time.sleep(0.01)
            server.send_signal(signal.SIGTERM)
            request.join(60)
        assert server.wait(60) == 0
        assert answers and answers[0].status_code == 200
        assert not list(tmp_path.glob("mmproc-serve-*"))  # the demo model's folder is gone
    finally:
        if server.poll() is None:
            server.kill()
