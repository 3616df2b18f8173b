"""One ``mmproc serve`` under load while its caches fill: req/s and CPU per request, batch by batch.

A server keeps each new picture's outputs in its processor-output cache until the cache is full
(4 GiB by default), so until then every new picture's megabytes are new memory, which the
kernel must fault in and zero; once full, the cache recycles its memory. This script starts
one server on the qwen_vl plugin's Qwen2-VL demo folder (``--native``: with an engine in a
process of its own, as ``benchmarks/serve.py`` does), then sends ``--batches`` batches of
``--requests`` new 1024x768 JPEG chat requests from ``--clients`` concurrent clients and prints,
per batch: req/s, p99 latency, the server's user and system CPU per request (system time is
mostly page faults here), the engine's CPU per request and the load generator's (all three
share the machine's cores), and the server's and the engine's resident memory. ``--cache-gb``
sizes every cache (default: the server's own). Where the figures change as the memory grows,
the cost of new memory shows: compare a run with default caches to one with ``--cache-gb 0.5``.

Run: ``.venv/bin/python benchmarks/serve_fill.py [--native] [--batches 5] [--cache-gb G]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as bench  # benchmarks/serve.py: the servers, the load, the pictures

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def engine_seconds(server: bench.Server) -> float:
    """The CPU seconds (user and system) of ``server``'s engine so far; 0 without one."""
    return 0.0 if server.engine is None else sum(cpu_seconds(server.engine.pid))


def resident_mib(pid: int) -> int:
    """Resident memory of process ``pid`` in MiB (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--native", action="store_true", help="with an engine (--engine)")
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--requests", type=int, default=192, help="new pictures per batch")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--cache-gb", type=float, help="every cache's size (default: the server's)")
    args = parser.parse_args()
    from mmproc_qwen_vl.demo import write_qwen2_vl_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_qwen2_vl_folder(Path(tmp) / "qwen2-vl")
        server = bench.mmproc_server(folder, args.native, args.cache_gb)
        try:
            bench.wait_healthy(server.port, server.process)
            warm = [bench.chat_body(bench.photo_jpeg(10_000 + i), "bench") for i in range(16)]
            asyncio.run(bench.load(server.port, warm, 2, len(warm)))
            caches = "default caches" if args.cache_gb is None else f"caches {args.cache_gb} GiB"
            print(
                f"{server.name}, {args.clients} clients, {args.requests} new pictures a batch, "
                f"{caches}\n"
            )
            print(
                "| batch | req/s | p99 ms | user ms/req | sys ms/req | engine ms/req "
                "| client ms/req | server MiB | engine MiB |"
            )
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            pid = server.process.pid
            for batch in range(args.batches):
                first = 1_000_000 + batch * args.requests
                bodies = [
                    bench.chat_body(bench.photo_jpeg(first + i), "bench")
                    for i in range(args.requests)
                ]
                user, system = cpu_seconds(pid)
                engine_cpu = engine_seconds(server)
                client = os.times()
                row = asyncio.run(bench.load(server.port, bodies, args.clients, len(bodies)))
                client_after = os.times()
                user_after, system_after = cpu_seconds(pid)
                per_request = 1e3 / len(bodies)
                client_cpu = sum(client_after[:2]) - sum(client[:2])
                engine_ms, engine_mib = "", ""
                if server.engine is not None:
                    engine_ms = f"{(engine_seconds(server) - engine_cpu) * per_request:.1f}"
                    engine_mib = str(resident_mib(server.engine.pid))
                print(
                    f"| {batch} | {row['rps']:.1f} | {row['p99']:.0f} "
                    f"| {(user_after - user) * per_request:.1f} "
                    f"| {(system_after - system) * per_request:.1f} | {engine_ms} "
                    f"| {client_cpu * per_request:.1f} | {resident_mib(pid)} | {engine_mib} |",
                    flush=True,
                )
        finally:
            server.close()


if __name__ == "__main__":
    main()
