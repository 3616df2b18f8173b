"""``mmproc serve``: a real server on 127.0.0.1 (uvicorn on a free port) and a real HTTP client.

The render endpoints in vLLM's format, the native path to a real ``RequestReceiver``, every
refusal the server makes, concurrent clients, and shutdown by SIGTERM.
"""

from __future__ import annotations

import base64
import io
import os
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
import pytest
import torch
import uvicorn
from _tiny_models import TinyQwenImageModel
from mmproc import hookimpl
from mmproc.serve import ServeSettings, create_app
from mmproc.testing import noise_image
from mmproc.wire import RequestReceiver

MODEL = "tiny-qwen"


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

    def start(folder: Path = qwen_folder, registry: Any = None, **settings: Any) -> Served:
        options = {"registry": registry} if registry is not None else {}
        processor = mmproc.get_processor(folder, warm_up=True, **options)
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


# --- the render endpoints -----------------------------------------------------------------------


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


def test_the_native_path_sends_the_request_to_the_engine_and_answers_without_tensors(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    with RequestReceiver(address, bind=True) as receiver:
        native = serve(engine=address)
        received: list[Any] = []
        reader = threading.Thread(target=lambda: received.append(receiver.recv(timeout=30)))
        reader.start()
        response = native.chat(image_chat(30), request_id="n1", max_tokens=8)
        reader.join(30)
        assert response.status_code == 200, response.text
        answer = response.json()
        [request] = received
        assert answer["engine_request_id"] == request.request_id == "chatcmpl-n1"
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


def test_sigterm_drains_the_request_in_flight_and_exits_0(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmproc.cli",
            "serve",
            "--model",
            "demo:qwen2-vl",
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and server.poll() is None, "did not start"
                time.sleep(0.2)
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
    finally:
        if server.poll() is None:
            server.kill()
