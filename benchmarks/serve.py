"""Benchmark ``mmproc serve`` under load, against vLLM's render server on the same folder.

Run: ``.venv/bin/python benchmarks/serve.py [--vllm PEER_VENV] [--requests N] [--rounds R]``.
Each server runs in its own process on the qwen_vl plugin's Qwen2-VL demo folder; all are started
first, then loaded one at a time (never two at once: they would share the cores), in rounds: in
each round every row is measured on every server in turn, so that the servers share this
machine's slow and fast spells alike (a virtual machine's speed drifts by tens of percent from
minute to minute). The load comes from this process (asyncio), which reads each answer's bytes
and its status and nothing more, alike for every server: by default on raw keep-alive
connections, each answer read into one reused buffer, since on one machine the client's CPU is
taken from the servers' and httpx spends about as much reading a 6 MB answer as a server spends
making it (``--client httpx`` measures with it). The requests are chat requests holding one
1024x768 JPEG as a ``data:`` URL, as clients send them: a new picture in each request
("distinct"), or the same one in all ("repeated"). ``--cache-gb`` sizes every cache alike
(mmproc's, the engine's, vLLM's), for a server that has run long enough to fill them; by
default each keeps its own.

Prints one Markdown table: per server and mode, per number of concurrent clients (1, 8, 32),
requests per second (the median over the rounds, and each round's), p50 and p99 latency (medians
over the rounds), and the answer's size. The modes:

* ``mmproc json``: ``mmproc serve``'s answer in vLLM's format (``kwargs_data``);
* ``mmproc native``: ``mmproc serve --engine``: the request goes to an engine over mmproc's wire
  (a ``RequestReceiver`` in a process of its own takes and acknowledges it) and the answer
  carries no tensors;
* ``vllm``: ``vllm launch render`` (with ``--vllm PEER_VENV``: a virtual environment with vLLM
  0.33, as ``../shared/peer/build_vllm_peer.sh`` builds it).

With ``--stages``, first a table of where one request's time goes: distinct requests one at a time
through the server's app in this process (1 worker), the processor's stages
(``Processor.recording_stages``) and the server's own (``/metrics``: encoding the items in vLLM's
format, serialising the JSON), mean milliseconds per request.

Then the targets of the render-tier issue, from this run, each ratio the median of the rounds'
ratios: mmproc's JSON endpoint at least 2x vLLM's req/s at 1 and 8 clients with p99 at 8 no worse
than vLLM's; the native path at least 3x vLLM's req/s at 8.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

CLIENTS = (1, 8, 32)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def photo_jpeg(seed: int, width: int = 1024, height: int = 768) -> bytes:
    """A 1024x768 picture with a photo's mix of smooth areas and detail, as a JPEG."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
    smooth = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    grain = rng.integers(-12, 13, (height, width, 3))
    pixels = np.clip(np.asarray(smooth).astype(np.int16) + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def chat_body(jpeg: bytes, model: str) -> bytes:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    import json

    return json.dumps(
        {
            "model": model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "What is in this picture?"},
                    ],
                }
            ],
        }
    ).encode()


def wait_healthy(port: int, process: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError("the server did not become healthy")


class _AnswerReader(asyncio.BufferedProtocol):
    """Reads HTTP/1.1 answers into one reused buffer (the kernel copies each byte once, into
    memory already faulted in), keeping only each answer's status and length."""

    _HEAD_LIMIT = 64 << 10

    def __init__(self) -> None:
        self._buffer = bytearray(1 << 20)
        self._view = memoryview(self._buffer)
        self._head = bytearray()
        self._left = 0  # body bytes still to come
        self._chunked: bytearray | None = None  # a chunked body, kept to be parsed
        self._status = 0
        self._answer: asyncio.Future[tuple[int, int]] | None = None
        self._size = 0
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def expect(self) -> asyncio.Future[tuple[int, int]]:
        self._answer = asyncio.get_running_loop().create_future()
        self._head.clear()
        self._left = -1  # the head first
        return self._answer

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        data = self._view[:nbytes]
        if self._left < 0:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > self._HEAD_LIMIT:
                    self._fail(ConnectionError("an answer's head is too long"))
                return
            head, rest = bytes(self._head[:end]), bytes(self._head[end + 4 :])
            self._status = int(head.split(b" ", 2)[1])
            fields = dict(
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
            )
            if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
                self._chunked = bytearray()
                self._left = 0
                self._size = 0
            else:
                self._chunked = None
                self._left = self._size = int(fields[b"content-length"])
            data = memoryview(rest)
        if self._chunked is not None:
            self._chunked += data
            self._read_chunks()
            return
        self._left -= len(data)
        if self._left <= 0 and self._answer is not None and not self._answer.done():
            self._answer.set_result((self._status, self._size))

    def _read_chunks(self) -> None:
        body = self._chunked
        assert body is not None
        while True:
            line_end = body.find(b"\r\n")
            if line_end < 0:
                return
            length = int(bytes(body[:line_end]).split(b";")[0], 16)
            if len(body) < line_end + 2 + length + 2:
                return
            del body[: line_end + 2 + length + 2]
            self._size += length
            if length == 0:
                self._chunked = None
                if self._answer is not None and not self._answer.done():
                    self._answer.set_result((self._status, self._size))
                return

    def _fail(self, exc: Exception) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("the server closed the connection mid-answer"))


class RawConnection:
    """One keep-alive HTTP/1.1 connection that sends a POST and reads the answer into a reused
    buffer, keeping only its status and length: a client that takes little of the cores the
    servers need (httpx spends about as much CPU reading a 6 MB answer as the server spends
    making it; asyncio's streams copy each byte twice more, into new memory)."""

    def __init__(self, port: int, path: str) -> None:
        self.port = port
        self.path = path
        self._reader: _AnswerReader | None = None

    async def post(self, body: bytes) -> tuple[int, int]:
        if self._reader is None or self._reader.closed:
            loop = asyncio.get_running_loop()
            _, self._reader = await loop.create_connection(_AnswerReader, "127.0.0.1", self.port)
        reader = self._reader
        assert reader.transport is not None
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        answer = reader.expect()
        reader.transport.writelines((head.encode(), body))
        return await answer

    async def close(self) -> None:
        if self._reader is not None and self._reader.transport is not None:
            self._reader.transport.close()
        self._reader = None


async def load(
    port: int, bodies: list[bytes], clients: int, requests: int, client: str = "raw"
) -> dict[str, Any]:
    """``requests`` requests from ``clients`` concurrent clients, bodies taken in turn, with the
    raw client or httpx."""
    latencies: list[float] = []
    sizes: list[int] = []
    failures = 0
    next_index = 0
    path = "/v1/chat/completions/render"
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(timeout=120, limits=limits) as pool:

        async def post_httpx(body: bytes) -> tuple[int, int]:
            url = f"http://127.0.0.1:{port}{path}"
            headers = {"Content-Type": "application/json"}
            response = await pool.post(url, content=body, headers=headers)
            return response.status_code, len(response.content)

        async def one_client() -> None:
            nonlocal next_index, failures
            raw = RawConnection(port, path)
            post = raw.post if client == "raw" else post_httpx
            try:
                while next_index < requests:
                    body = bodies[next_index % len(bodies)]
                    next_index += 1
                    start = time.perf_counter()
                    status, size = await post(body)
                    latencies.append(time.perf_counter() - start)
                    sizes.append(size)
                    failures += status != 200
            finally:
                await raw.close()

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {
        "rps": len(latencies) / wall,
        "p50": statistics.median(latencies) * 1e3,
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        "bytes": statistics.median(sizes),
        "failures": failures,
    }


# The engine of the native path: a process of its own, as an engine is, so that receiving the
# tensors takes none of the load generator's interpreter. It takes every request until killed.
ENGINE = """
import sys
from mmproc.wire import RequestReceiver

options = {"item_cache_bytes": int(sys.argv[2])} if len(sys.argv) > 2 else {}
receiver = RequestReceiver(sys.argv[1], bind=True, **options)
print("ready", flush=True)
while True:
    receiver.recv(timeout=1.0)
"""


class Server:
    """One server under test, started in its own process: mmproc serve (JSON or native, with
    its engine in another process) or vLLM's render server."""

    def __init__(
        self,
        name: str,
        command: list[str],
        env: dict[str, str] | None = None,
        engine_cache_bytes: int | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.engine: subprocess.Popen[bytes] | None = None
        command = [*command, "--port", str(self.port)]
        if name == "mmproc native":
            address = f"ipc://{tempfile.mkdtemp()}/engine.sock"
            engine = [sys.executable, "-c", ENGINE, address]
            if engine_cache_bytes is not None:
                engine.append(str(engine_cache_bytes))
            self.engine = subprocess.Popen(engine, stdout=subprocess.PIPE)
            if self.engine.stdout is None or self.engine.stdout.readline() != b"ready\n":
                raise RuntimeError("the engine did not start")
            command += ["--engine", address]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )

    def close(self) -> None:
        for process in (self.process, self.engine):
            if process is not None:
                process.terminate()
                process.wait(60)


def mmproc_server(
    folder: Path, native: bool, cache_gb: float | None, extra: list[str] | None = None
) -> Server:
    command = [sys.executable, "-m", "mmproc.cli", "serve", "--model", str(folder)]
    command += ["--served-model-name", "bench", "--log-level", "warning", *(extra or [])]
    cache_bytes = None if cache_gb is None else int(cache_gb * (1 << 30))
    if cache_bytes is not None:
        command += ["--option", f"cache_bytes={cache_bytes}"]
        command += ["--encoded-item-cache-bytes", str(cache_bytes)]
        if native:  # what the engine keeps (its item_cache_bytes below), the server knows
            command += ["--engine-item-cache-bytes", str(cache_bytes)]
    name = "mmproc native" if native else "mmproc json"
    return Server(name, command, engine_cache_bytes=cache_bytes)


def vllm_server(venv: Path, folder: Path, cache_gb: float | None) -> Server:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    command = [str(venv / "bin" / "vllm"), "launch", "render", str(folder)]
    command += ["--host", "127.0.0.1", "--served-model-name", "bench"]
    if cache_gb is not None:
        command += ["--mm-processor-cache-gb", str(cache_gb)]
    return Server("vllm", command, env)


Results = dict[tuple[str, str, int], list[dict[str, Any]]]


def measure(
    servers: list[Server], jpegs: list[bytes], requests: int, rounds: int, client: str
) -> Results:
    """``rounds`` rounds; in each, every row (pictures x clients) is measured on every server in
    turn, so that all servers share the machine's slow and fast spells alike. A round's distinct
    pictures are new to every server (each keeps its own cache) and the same for all of them."""
    for server in servers:
        wait_healthy(server.port, server.process)
    # Warm up: clones, the first decode, the JIT of the first requests.
    warm = [chat_body(photo_jpeg(10_000 + i), "bench") for i in range(4)]
    for server in servers:
        asyncio.run(load(server.port, warm, 2, 8, client))
    repeated = [chat_body(jpegs[0], "bench")]
    results: Results = {}
    for round_ in range(rounds):
        for clients in CLIENTS:
            count = max(requests, 4 * clients)
            offset = 100_000 * (round_ + 1) + clients * 1000
            fresh = [chat_body(photo_jpeg(offset + i), "bench") for i in range(count)]
            for server in servers:
                for mode, bodies in (("distinct", fresh), ("repeated", repeated)):
                    row = asyncio.run(load(server.port, bodies, clients, count, client))
                    results.setdefault((server.name, mode, clients), []).append(row)
    return results


def stage_table(folder: Path, count: int) -> None:
    """Mean milliseconds per stage of ``count`` distinct chat requests, one at a time."""
    import mmproc
    from mmproc.serve.allocator import keep_freed_memory, reserve_heap
    from mmproc.serve.app import ServeSettings, create_app
    from mmproc.stages import STAGES

    keep_freed_memory()  # as mmproc serve does
    reserve_heap()

    bodies = [chat_body(photo_jpeg(50_000 + i), "bench") for i in range(count + 2)]
    with mmproc.get_processor(folder, workers=1) as processor:
        app = create_app(processor, ServeSettings(served_model_names=("bench",)))
        registry = app.state.server.metrics.registry

        async def send(batch: list[bytes]) -> list[float]:
            transport = httpx.ASGITransport(app=app)
            seconds = []
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
                for body in batch:
                    start = time.perf_counter()
                    response = await client.post("/v1/chat/completions/render", content=body)
                    seconds.append(time.perf_counter() - start)
                    response.raise_for_status()
            return seconds

        asyncio.run(send(bodies[:2]))  # the first clone, the first decode

        def server_seconds(stage: str) -> float:
            labels = {"endpoint": "chat", "stage": stage}
            return registry.get_sample_value("mmproc_request_seconds_sum", labels) or 0.0

        before = {stage: server_seconds(stage) for stage in ("encode", "serialise", "total")}
        with processor.recording_stages() as log:
            client_seconds = asyncio.run(send(bodies[2:]))
        server = {stage: server_seconds(stage) - before[stage] for stage in before}
    rows = {stage: 0.0 for stage in STAGES}
    for clock in log:
        for stage, seconds in clock.seconds.items():
            rows[stage] += seconds
    rows["encode (kwargs_data: msgpack, base64)"] = server["encode"]
    rows["serialise (JSON)"] = server["serialise"]
    rows["server, the rest (body, routing, threads)"] = server["total"] - sum(rows.values())
    rows["server total"] = server["total"]
    rows["client-seen total"] = sum(client_seconds)
    print(f"stages of one chat request (one 1024x768 JPEG, 1 worker, mean of {count})\n")
    print("| stage | ms |")
    print("|---|---:|")
    for stage, seconds in rows.items():
        if seconds:
            print(f"| {stage} | {seconds / count * 1e3:.2f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", type=Path, help="a virtual environment with vLLM 0.33")
    parser.add_argument(
        "--requests", type=int, default=64, help="requests per row (at least 4 per client)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all rows and servers")
    parser.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="the load's HTTP client: raw asyncio streams (default: light) or httpx",
    )
    parser.add_argument(
        "--cache-gb",
        type=float,
        help="every cache's size in GiB, alike for all (mmproc's processor cache and encoded "
        "items, the engine's items, vLLM's --mm-processor-cache-gb); default: each server's own. "
        "Small caches measure a long-running server, whose caches are full and recycle memory",
    )
    parser.add_argument("--skip-native", action="store_true")
    parser.add_argument(
        "--mmproc-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for both mmproc servers' command line, e.g. "
        "--mmproc-arg=--heap-reserve-bytes=0 (repeatable)",
    )
    parser.add_argument(
        "--stages", action="store_true", help="first, where one request's time goes"
    )
    parser.add_argument("--only-stages", action="store_true", help="the stage table alone")
    args = parser.parse_args()
    from mmproc_qwen_vl.demo import write_qwen2_vl_folder

    jpegs = [photo_jpeg(i) for i in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_qwen2_vl_folder(Path(tmp) / "qwen2-vl")
        if args.stages or args.only_stages:
            stage_table(folder, 16)
        if args.only_stages:
            return
        servers = [mmproc_server(folder, False, args.cache_gb, args.mmproc_arg)]
        if not args.skip_native:
            servers.append(mmproc_server(folder, True, args.cache_gb, args.mmproc_arg))
        if args.vllm is not None:
            servers.append(vllm_server(args.vllm, folder, args.cache_gb))
        try:
            results = measure(servers, jpegs, args.requests, args.rounds, args.client)
        finally:
            for server in servers:
                server.close()
    report(results, args)


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def _ratio(results: Results, name: str, clients: int) -> float:
    """The median over rounds of ``name``'s req/s over vLLM's in the same round (distinct)."""
    ours, theirs = results[(name, "distinct", clients)], results[("vllm", "distinct", clients)]
    return statistics.median(a["rps"] / b["rps"] for a, b in zip(ours, theirs, strict=True))


def report(results: Results, args: argparse.Namespace) -> None:
    print(f"one 1024x768 JPEG per chat request; {args.requests}+ requests a row, ", end="")
    print(
        f"{args.rounds} rounds, the servers in turn within each; medians over the rounds; ", end=""
    )
    caches = "servers' default caches" if args.cache_gb is None else f"caches {args.cache_gb} GiB"
    extra = f"; mmproc serve {' '.join(args.mmproc_arg)}" if args.mmproc_arg else ""
    print(f"{args.client} client; {caches}{extra}\n")
    print(
        "| server | pictures | clients | req/s | req/s by round | p50 ms | p99 ms "
        "| answer bytes | failed |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    for (name, mode, clients), rows in results.items():
        by_round = " ".join(f"{row['rps']:.1f}" for row in rows)
        failed = sum(row["failures"] for row in rows)
        print(
            f"| {name} | {mode} | {clients} | {_median(rows, 'rps'):.1f} | {by_round} "
            f"| {_median(rows, 'p50'):.1f} | {_median(rows, 'p99'):.1f} "
            f"| {_median(rows, 'bytes'):,.0f} | {failed} |"
        )
    if args.vllm is None:
        return
    print("\ntargets (distinct pictures; ratios: the median of the rounds' ratios):")
    for clients in (1, 8):
        ratio = _ratio(results, "mmproc json", clients)
        verdict = "met" if ratio >= 2 else "missed"
        print(f"- JSON at {clients} clients: {ratio:.2f}x vLLM's req/s (>= 2x): {verdict}")
    p99 = (
        _median(results[("mmproc json", "distinct", 8)], "p99"),
        _median(results[("vllm", "distinct", 8)], "p99"),
    )
    verdict = "met" if p99[0] <= p99[1] else "missed"
    print(f"- JSON p99 at 8 clients: {p99[0]:.1f} ms, vLLM {p99[1]:.1f} ms: {verdict}")
    if ("mmproc native", "distinct", 8) in results:
        ratio = _ratio(results, "mmproc native", 8)
        verdict = "met" if ratio >= 3 else "missed"
        print(f"- native at 8 clients: {ratio:.2f}x vLLM's req/s (>= 3x): {verdict}")


if __name__ == "__main__":
    main()
