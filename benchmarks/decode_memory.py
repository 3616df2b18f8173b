"""Benchmark of what a message costs to decode: peak RSS growth of `decode_request`, per shape.

Every message is a msgpack body of one shape -- empty arrays, empty maps, one-entry maps, small
negative ints, short strings, non-Latin-1 characters, floats, nils, deep maps, distinct keys, tiny
inline tensors, one big string, seeded random values, a valid request with inline tensors, and a
top-level array -- at several sizes (16 KiB to 16 MiB, the default body limit), mostly inside an
engine request's ``params`` so that the request's own checks do not stop it early.

How peak RSS is measured: each case runs in a fresh Python process. It imports mmproc, decodes a
small request through each path once (parsed whole, value by value, refused), so that lazy
imports and first-call allocations are not counted, reads
the message from a file (the message's own bytes are resident before the measurement), collects
garbage, trims malloc's free memory, then resets the kernel's high-water mark of resident memory
(``/proc/self/clear_refs``, Linux >= 4.0) and reads VmRSS. After ``decode_request`` returns or
raises, growth = VmHWM - VmRSS before: every page the decode touched, Python objects, tensor
objects and allocator overhead included. The ratio is that growth over the message's size; the
target is at most 16x for any message, accepted or refused (for messages under 16 KiB, the
256 KiB any message may use is more than 16x: `mmproc.wire.DecodeLimits.memory_allowance`).

    python benchmarks/decode_memory.py            # 16 KiB to 16 MiB (a few minutes)
    python benchmarks/decode_memory.py --quick    # 16 KiB to 1 MiB
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

KIB = 1024
MIB = 1024 * KIB
SIZES = [16 * KIB, 64 * KIB, 1 * MIB, 16 * MIB - 4 * KIB]  # the last one just under the limit
TARGET = 16


# --- the messages ---------------------------------------------------------------------------------


def request_body(params_value: bytes) -> bytes:
    """An engine request's body whose params hold one raw msgpack value."""
    head = msgpack.packb(
        {
            "schema_version": 2,
            "request_id": "bench",
            "prompt_token_ids": ["<i8", [1], msgpack.ExtType(3, bytes(8))],
            "features": [],
        }
    )
    return b"\x85" + head[1:] + msgpack.packb("params") + b"\x81\xa1x" + params_value


def array_header(count: int) -> bytes:
    return b"\xdd" + struct.pack(">I", count)


def chunked(item: bytes, size: int, per_chunk: int = 1000) -> bytes:
    """Arrays of ``per_chunk`` copies of ``item`` in one array, about ``size`` bytes in all."""
    chunk = b"\xdc" + struct.pack(">H", per_chunk) + item * per_chunk
    count = max(1, size // len(chunk))
    return array_header(count) + chunk * count


def distinct_keys(size: int) -> bytes:
    count = size // 8
    entries = b"".join(b"\xa6" + f"{index:06x}".encode() + b"\xc0" for index in range(count))
    return b"\xdf" + struct.pack(">I", count) + entries


def deep_maps(size: int) -> bytes:
    # maps nested 30 deep, each level one key; many of them side by side
    one = b"\x81\xa1k" * 30 + b"\xc0"
    count = size // len(one)
    return array_header(count) + one * count


def random_values(size: int, seed: int = 12) -> bytes:
    """Seeded random msgpack values: scalars of every kind, arrays and maps, nested."""
    rng = random.Random(seed)

    def value(depth: int) -> object:
        pick = rng.random()
        if depth < 6 and pick < 0.15:
            return [value(depth + 1) for _ in range(rng.randint(0, 6))]
        if depth < 6 and pick < 0.25:
            return {f"k{rng.randint(0, 99)}": value(depth + 1) for _ in range(rng.randint(0, 4))}
        return rng.choice(
            [
                None,
                True,
                rng.randint(-40, 300),
                rng.randint(-(2**40), 2**40),
                rng.random(),
                "".join(rng.choice("aé中𐀀") for _ in range(rng.randint(0, 4))),
                bytes(rng.randint(0, 3)),
            ]
        )

    items = []
    total = 0
    while total < size:
        packed = msgpack.packb(value(0), use_bin_type=True)
        items.append(packed)
        total += len(packed)
    return array_header(len(items)) + b"".join(items)


def valid_request(size: int) -> bytes:
    """A well-formed request whose tensors all travel inline (threshold above their size)."""
    import torch
    from mmproc.wire import EngineRequest, WireFeature, encode_request

    count = max(1, size // (65 * KIB))
    rows = max(1, min(64, size // KIB - 2))  # a pixel tensor of 1 KiB rows, up to 64 KiB
    features = [
        WireFeature(
            "image",
            index,
            "0" * 64,
            0,
            1,
            None,
            {"pixel_values": torch.zeros(rows, 1024, dtype=torch.uint8), "grid": torch.ones(3)},
            {"mean": [0.5] * 3, "std": [0.5] * 3, "rescale": 1 / 255},
        )
        for index in range(count)
    ]
    request = EngineRequest("bench", [1, 2, 3], features, {"max_tokens": 16})
    (body,) = encode_request(request, threshold=1 << 30)
    return body


SHAPES: dict[str, Callable[[int], bytes]] = {
    "empty arrays": lambda n: request_body(chunked(b"\x90", n)),
    "empty maps": lambda n: request_body(chunked(b"\x80", n)),
    "one-entry maps": lambda n: request_body(chunked(b"\x81\xa0\xc0", n)),
    "ints -32..-6": lambda n: request_body(chunked(b"\xf0", n)),
    "two-char strings": lambda n: request_body(chunked(b"\xa2ab", n)),
    "non-Latin-1 chars": lambda n: request_body(chunked(b"\xa2\xc4\x80", n)),
    "floats": lambda n: request_body(chunked(b"\xca\x3f\x80\x00\x01", n)),
    "nils": lambda n: request_body(chunked(b"\xc0", n)),
    "deep maps": lambda n: request_body(deep_maps(n)),
    "distinct keys": lambda n: request_body(distinct_keys(n)),
    "tiny tensors": lambda n: request_body(chunked(b"\x93\xa5uint8\x91\x01\xd4\x03\x00", n)),
    "one big string": lambda n: request_body(b"\xdb" + struct.pack(">I", n) + b"a" * n),
    "random values": lambda n: request_body(random_values(n)),
    "valid, tensors inline": valid_request,
    "top-level array": lambda n: array_header(n) + b"\x90" * n,
}


# --- one case, in its own process ------------------------------------------------------------

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"{field} not in {_STATUS}")
    return int(match.group(1))


def measure_case(path: str) -> dict[str, object]:
    """Decode the message in ``path`` (in this fresh process) and report its cost."""
    import torch
    from mmproc.errors import DecodeError
    from mmproc.wire import DecodeLimits, EngineRequest, decode_request, encode_request

    # Every path once, on small messages: parsed whole, value by value, and refused for its cost,
    # and a request like the valid ones below. What a process pays once (code caches, first
    # exceptions, torch's first tensors of a dtype) is then not counted per message.
    warm = encode_request(EngineRequest("warm", [1, 2], [], {"t": torch.ones(4), "s": ["ab"]}))
    decode_request(warm)
    decode_request([valid_request(2 * KIB)])
    decode_request(warm, limits=DecodeLimits(max_objects=64))
    try:
        decode_request(warm, limits=DecodeLimits(max_memory_ratio=1, memory_allowance=0))
    except DecodeError:
        pass
    body = Path(path).read_bytes()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass  # not glibc: freed heap may stay resident and hide part of the growth
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    try:
        decode_request([body])
        outcome = "accepted"
    except DecodeError as exc:
        outcome = "refused: " + str(exc)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    return {
        "size": len(body),
        "growth": (peak - before) * KIB,
        "seconds": seconds,
        "outcome": outcome,
    }


def run_case(body: bytes, workdir: str) -> dict[str, object]:
    path = os.path.join(workdir, "message.bin")
    Path(path).write_bytes(body)
    result = subprocess.run(
        [sys.executable, __file__, "--measure", path],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"measurement failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- the table ---------------------------------------------------------------------------------


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB else f"{nbytes / KIB:.0f} KiB"


def _why(outcome: str) -> str:
    if outcome == "accepted":
        return "accepted"
    for needle, short in (
        ("bytes of objects", "refused: memory budget"),
        ("values (DecodeLimits.max_objects)", "refused: max_objects"),
        ("arrays and maps", "refused: max_containers"),
        ("must be a map", "refused: not a map"),
        ("nested deeper", "refused: depth"),
    ):
        if needle in outcome:
            return short
    return "refused: " + outcome.removeprefix("refused: ")[:40]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 KiB to 1 MiB only")
    parser.add_argument("--measure", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_case(args.measure)))
        return
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("needs Linux: the kernel's RSS high-water mark is reset per case")
    sizes = SIZES[:3] if args.quick else SIZES
    print(
        f"decode_request: peak RSS growth per message (fresh process per case; target <= "
        f"{TARGET}x the message size)\n"
    )
    head = f"{'shape':<22} {'message':>9} | {'peak growth':>11} {'ratio':>7} | {'ms':>8} | outcome"
    print(head)
    print("-" * (len(head) + 10))
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="mmproc-decode-memory-") as workdir:
        for name, build in SHAPES.items():
            for size in sizes:
                body = build(size)
                result = run_case(body, workdir)
                growth = int(result["growth"])  # type: ignore[call-overload]
                ratio = growth / len(body)
                worst = max(worst, ratio)
                mark = "" if ratio <= TARGET else "  <-- over target"
                print(
                    f"{name:<22} {_size(len(body)):>9} | {growth / MIB:>7.2f} MiB "
                    f"{ratio:>6.1f}x | {float(result['seconds']) * 1e3:>8.1f} | "  # type: ignore[arg-type]
                    f"{_why(str(result['outcome']))}{mark}",
                    flush=True,
                )
    print(f"\nworst ratio: {worst:.1f}x (target <= {TARGET}x)")


if __name__ == "__main__":
    main()
