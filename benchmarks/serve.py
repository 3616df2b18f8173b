"""Benchmark ``mmproc serve`` under load, against vLLM's render server on the same folder.

Run: ``.venv/bin/python benchmarks/serve.py [--vllm PEER_VENV] [--requests N]``. Each server runs
in its own process, one at a time (never both at once: they would share the cores), on the
qwen_vl plugin's Qwen2-VL demo folder; the load comes from this process (httpx, asyncio), which
reads each answer's bytes and its status and nothing more, alike for every server. The requests
are chat requests holding one 1024x768 JPEG as a ``data:`` URL, as clients send them: a new
picture in each request ("distinct"), or the same one in all ("repeated").

Prints one Markdown table: per server and mode, per number of concurrent clients (1, 8, 32),
requests per second, p50 and p99 latency, and the answer's size. The modes:

* ``mmproc json``: ``mmproc serve``'s answer in vLLM's format (``kwargs_data``);
* ``mmproc native``: ``mmproc serve --engine``: the request goes to an engine over mmproc's wire
  (a ``RequestReceiver`` in this process acknowledges it) and the answer carries no tensors;
* ``vllm``: ``vllm launch render`` (with ``--vllm PEER_VENV``: a virtual environment with vLLM
  0.33, as ``../shared/peer/build_vllm_peer.sh`` builds it).

With ``--stages``, first a table of where one request's time goes: distinct requests one at a time
through the server's app in this process (1 worker), the processor's stages
(``Processor.recording_stages``) and the server's own (``/metrics``: encoding the items in vLLM's
format, serialising the JSON), mean milliseconds per request.

Then the targets of the render-tier issue, from this run: mmproc's JSON endpoint at least 2x
vLLM's req/s at 1 and 8 clients with p99 at 8 no worse than vLLM's; the native path at least 3x
vLLM's req/s at 8.
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
import threading
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


async def load(port: int, bodies: list[bytes], clients: int, requests: int) -> dict[str, Any]:
    """``requests`` requests from ``clients`` concurrent clients, bodies taken in turn."""
    latencies: list[float] = []
    sizes: list[int] = []
    failures = 0
    next_index = 0
    url = f"http://127.0.0.1:{port}/v1/chat/completions/render"
    headers = {"Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one_client() -> None:
            nonlocal next_index, failures
            while next_index < requests:
                body = bodies[next_index % len(bodies)]
                next_index += 1
                start = time.perf_counter()
                response = await client.post(url, content=body, headers=headers)
                latencies.append(time.perf_counter() - start)
                sizes.append(len(response.content))
                failures += response.status_code != 200

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


def measure(port: int, jpegs: list[bytes], model: str, requests: int) -> dict[tuple[str, int], Any]:
    repeated = [chat_body(jpegs[0], model)]
    # Warm up: clones, the first decode, the JIT of the first requests.
    asyncio.run(load(port, [chat_body(photo_jpeg(10_000 + i), model) for i in range(4)], 2, 8))
    results = {}
    for clients in CLIENTS:
        count = max(requests, 4 * clients)
        # New pictures each round: a picture seen in an earlier round would be a cache hit.
        offset = clients * 1000
        fresh = [chat_body(photo_jpeg(offset + i), model) for i in range(count)]
        results[("distinct", clients)] = asyncio.run(load(port, fresh, clients, count))
        results[("repeated", clients)] = asyncio.run(load(port, repeated, clients, count))
    return results


def run_mmproc(folder: Path, jpegs: list[bytes], requests: int, native: bool) -> Any:
    port = free_port()
    command = [sys.executable, "-m", "mmproc.cli", "serve", "--model", str(folder)]
    command += ["--port", str(port), "--served-model-name", "bench", "--log-level", "warning"]
    receiver = None
    stop = threading.Event()
    if native:
        from mmproc.wire import RequestReceiver

        address = f"ipc://{tempfile.mkdtemp()}/engine.sock"
        receiver = RequestReceiver(address, bind=True)

        def drain() -> None:
            while not stop.is_set():
                receiver.recv(timeout=0.1)

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        command += ["--engine", address]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, process)
        return measure(port, jpegs, "bench", requests)
    finally:
        process.terminate()
        process.wait(60)
        stop.set()
        if receiver is not None:
            drainer.join(5)  # before its socket closes under it
            receiver.close()


def run_vllm(venv: Path, folder: Path, jpegs: list[bytes], requests: int) -> Any:
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    command = [str(venv / "bin" / "vllm"), "launch", "render", str(folder)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench"]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    try:
        wait_healthy(port, process)
        return measure(port, jpegs, "bench", requests)
    finally:
        process.terminate()
        process.wait(60)


def stage_table(folder: Path, count: int) -> None:
    """Mean milliseconds per stage of ``count`` distinct chat requests, one at a time."""
    import mmproc
    from mmproc.serve.app import ServeSettings, create_app
    from mmproc.stages import STAGES

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
    parser.add_argument("--skip-native", action="store_true")
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
        runs: dict[str, Any] = {"mmproc json": run_mmproc(folder, jpegs, args.requests, False)}
        if not args.skip_native:
            runs["mmproc native"] = run_mmproc(folder, jpegs, args.requests, True)
        if args.vllm is not None:
            runs["vllm"] = run_vllm(args.vllm, folder, jpegs, args.requests)
    print(f"one 1024x768 JPEG ({len(jpegs[0]):,} bytes) per chat request", end="; ")
    print(f"{args.requests}+ requests a row\n")
    print("| server | pictures | clients | req/s | p50 ms | p99 ms | answer bytes | failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, results in runs.items():
        for (mode, clients), r in results.items():
            print(
                f"| {name} | {mode} | {clients} | {r['rps']:.1f} | {r['p50']:.1f} | {r['p99']:.1f} "
                f"| {r['bytes']:,.0f} | {r['failures']} |"
            )
    if "vllm" in runs:
        print("\ntargets (distinct pictures):")
        json_, vllm = runs["mmproc json"], runs["vllm"]
        for clients in (1, 8):
            ratio = json_[("distinct", clients)]["rps"] / vllm[("distinct", clients)]["rps"]
            verdict = "met" if ratio >= 2 else "missed"
            print(f"- JSON at {clients} clients: {ratio:.2f}x vLLM's req/s (>= 2x): {verdict}")
        p99 = (json_[("distinct", 8)]["p99"], vllm[("distinct", 8)]["p99"])
        verdict = "met" if p99[0] <= p99[1] else "missed"
        print(f"- JSON p99 at 8 clients: {p99[0]:.1f} ms, vLLM {p99[1]:.1f} ms: {verdict}")
        if "mmproc native" in runs:
            ratio = runs["mmproc native"][("distinct", 8)]["rps"] / vllm[("distinct", 8)]["rps"]
            verdict = "met" if ratio >= 3 else "missed"
            print(f"- native at 8 clients: {ratio:.2f}x vLLM's req/s (>= 3x): {verdict}")


if __name__ == "__main__":
    main()
