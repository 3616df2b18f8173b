"""Benchmark of mmproc's wire: zero-copy aux frames vs everything inline, and an ipc:// round trip.

For requests holding 1 or 4 tensors of 1 KiB .. 64 MiB it measures

* encode / decode time of the tensors alone (the codec), with aux frames (default threshold) and
  with everything inline in the msgpack body (threshold above the tensor size);
* the peak resident memory each of those adds (Linux: the kernel's high-water mark is reset
  before each measurement through /proc/self/clear_refs);
* encode_request / decode_request of a whole `EngineRequest` (schema included), and of requests
  that are all prompt, 64 to 128k tokens;
* ipc:// round trips, each message sent -> decoded -> acked with one byte: the tensors alone
  (encode / decode, as the reference measured) and a whole request (RequestSender ->
  RequestReceiver), each next to the same
  frames sent as raw ZMQ multipart messages (copy=False, no encode/decode) and to a plain memcpy
  of the same bytes (these senders keep no items: every request goes in full);
* items by reference (a 1024x768 Qwen2-VL image, 4.48 MiB, sent before): the bytes a repeated
  image costs on the wire, the engine-side decode of a request whose item is filled in from the
  receiver's cache next to the same request without media, the round trip of each, and the bytes
  of a 10-turn chat with one new image per turn, with and without references.

Reference (vLLM's serializer, measured on the seed's machine): ~3.4 us to encode a request with aux
frames whatever the tensor size (32 ms for a 64 MiB tensor inline), ~5 us to decode, no added peak
memory, round trip within 10-25% of raw frames. Targets: encode flat in tensor size and within
1.5x of those microseconds, no measurable added peak RSS, round trip within 25% of raw frames; a
repeated image at most 256 bytes on the wire, and the decode of a request whose items all come
by reference at most 2x that of the same request without media.

    python benchmarks/wire.py                    # full table (under a minute)
    python benchmarks/wire.py --quick            # up to 1 MiB, fewer repetitions
    python benchmarks/wire.py --wait-quiet 3     # on a shared machine: wait for quiet moments
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq
from mmproc.wire import (
    DEFAULT_ITEM_CACHE_BYTES,
    DecodeLimits,
    EngineRequest,
    ItemCache,
    RequestReceiver,
    RequestSender,
    WireFeature,
    decode,
    decode_request,
    encode,
    encode_request,
    item_key,
)
from mmproc.wire.schema import encode_request_refs

KIB = 1024
MIB = 1024 * KIB
SIZES = [1 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB]
COUNTS = [1, 4]
# Inline messages of 4 x 64 MiB are far over the default body limit, which is the point of it.
BIG_LIMITS = DecodeLimits(max_total_bytes=2 << 30, max_body_bytes=1 << 30)

REF_ENCODE_US = 3.4
REF_DECODE_US = 5.0


# --- measuring ----------------------------------------------------------------------------------


def time_per_call(fn: Callable[[], Any], *, budget_s: float, min_calls: int = 3) -> float:
    """Seconds per call: the median over batches, each batch as long as fits the budget / 5."""
    fn()  # warm up (first-call costs, page faults of fresh buffers)
    start = time.perf_counter()
    fn()
    single = max(time.perf_counter() - start, 1e-7)
    per_batch = max(1, int(budget_s / 5 / single))
    batches = max(min_calls, 5) if per_batch == 1 else 5
    results = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        results.append((time.perf_counter() - start) / per_batch)
    return statistics.median(results)


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"{field} not in {_STATUS}")
    return int(match.group(1))


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: RSS figures may then count memory malloc kept from earlier runs
    _LIBC = None


def added_peak_mib(fn: Callable[[], Any]) -> float | None:
    """Peak RSS the call adds over what was resident before it (its result included), in MiB.
    None where the kernel does not let us reset the high-water mark."""
    gc.collect()
    if _LIBC is not None:
        # Hand freed heap memory back first; otherwise malloc serves the call from pages that
        # are already resident and a copy would not show in the high-water mark.
        _LIBC.malloc_trim(0)
    try:
        _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        before = _status_kib("VmRSS")
    except OSError:
        return None
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    return max(0, peak - before) / 1024


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU jiffies of the whole machine so far, from /proc/stat."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def wait_until_quiet(max_wait_s: float, threshold: float = 0.1) -> None:
    """Wait (at most ``max_wait_s``) for a 0.25 s window in which the machine is < ``threshold``
    busy. Called between measurements, when this benchmark's own processes are idle, so what it
    sees is everybody else's load."""
    deadline = time.perf_counter() + max_wait_s
    while time.perf_counter() < deadline:
        before = _cpu_jiffies()
        time.sleep(0.25)
        after = _cpu_jiffies()
        if before is None or after is None:
            return
        if (after[0] - before[0]) / max(1, after[1] - before[1]) < threshold:
            return


def memcpy_seconds(nbytes: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return time_per_call(lambda: dst.copy_(src), budget_s=0.2)


# --- payloads -----------------------------------------------------------------------------------


def make_tensors(nbytes: int, count: int) -> list[torch.Tensor]:
    # uint8 pixel patches, as shipped when the engine normalises on the device
    return [torch.randint(0, 256, (nbytes // KIB, KIB), dtype=torch.uint8) for _ in range(count)]


def make_request(tensors: list[torch.Tensor]) -> EngineRequest:
    features = [
        WireFeature(
            modality="image",
            item_index=index,
            hash=f"{index:064x}",
            offset=1 + 4 * index,
            length=4,
            is_embed=None,
            data={"pixel_values": tensor, "image_grid_thw": torch.tensor([1, 2, 2])},
            norm={"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "rescale": 1 / 255},
        )
        for index, tensor in enumerate(tensors)
    ]
    return EngineRequest("bench", list(range(64)), features, {"max_tokens": 16})


def make_qwen_request(seed: int = 0) -> tuple[EngineRequest, list[torch.Tensor]]:
    """What a real request looks like: one 1024x768 image as Qwen2-VL's uint8 patches (grid
    1x54x74: 3996 patches of 1176 values, 4.48 MiB), its 999 placeholders in a 1,024-token
    prompt. ``seed`` picks the image (and its hash, 64 hex digits as blake3 makes them)."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (3996, 1176), dtype=torch.uint8, generator=generator)
    feature = WireFeature(
        modality="image",
        item_index=0,
        hash=f"{seed:064x}",
        offset=15,
        length=999,
        is_embed=None,
        data={"pixel_values": pixels, "image_grid_thw": torch.tensor([1, 54, 74])},
        norm={"mean": [0.48, 0.46, 0.41], "std": [0.27, 0.26, 0.28], "rescale": 1 / 255},
    )
    ids = torch.randint(0, 151_000, (1024,)).tolist()
    return EngineRequest("bench", ids, [feature], {"max_tokens": 16}), [pixels]


# --- round trips ------------------------------------------------------------------------------


def engine_main(workdir: str) -> None:
    """The engine process: a RequestReceiver (mmproc requests), a PULL socket decoding codec
    messages (`mmproc.wire.decode`) and a raw PULL socket, each acking what it receives. A separate
    process, as an engine core is, so it shares no GIL with the sender."""
    context: zmq.Context[Any] = zmq.Context()
    ack_address = f"ipc://{workdir}/ack.sock"

    def mmproc_engine() -> None:
        ack = context.socket(zmq.PUSH)
        ack.connect(ack_address)
        receiver = RequestReceiver(f"ipc://{workdir}/mmproc.sock", context=context)
        ack.send(b"ready")
        for got in receiver:
            ack.send(b"m")
            del got  # like the raw side, which drops its frames at once

    def codec_engine() -> None:
        ack = context.socket(zmq.PUSH)
        ack.connect(ack_address)
        pull = context.socket(zmq.PULL)
        pull.bind(f"ipc://{workdir}/codec.sock")
        ack.send(b"ready")
        while True:
            decode(pull.recv_multipart(copy=False), limits=BIG_LIMITS)
            ack.send(b"c")

    for target in (mmproc_engine, codec_engine):
        threading.Thread(target=target, daemon=True).start()
    ack = context.socket(zmq.PUSH)
    ack.connect(ack_address)
    pull = context.socket(zmq.PULL)
    pull.bind(f"ipc://{workdir}/raw.sock")
    ack.send(b"ready")
    while True:
        pull.recv_multipart(copy=False)
        ack.send(b"r")


# Untimed trips before each timed batch of round trips.
_TRIP_WARM_UP = 20


@dataclass
class RoundTrip:
    request_s: float
    """A whole EngineRequest: RequestSender.send -> RequestReceiver (decode_request) -> ack."""
    request_raw_s: float
    """The same request's frames, encoded beforehand, as raw multipart messages (no decode)."""
    codec_s: float
    """The tensors alone: encode -> send -> decode -> ack (what the reference measured)."""
    codec_raw_s: float
    """The codec's frames, encoded beforehand, as raw multipart messages (no decode)."""

    @property
    def request_ratio(self) -> float:
        return self.request_s / self.request_raw_s

    @property
    def codec_ratio(self) -> float:
        return self.codec_s / self.codec_raw_s


class Engine:
    """Owns the engine process and the front end's sockets to it."""

    def __init__(self, workdir: str) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.ack = self.context.socket(zmq.PULL)
        self.ack.bind(f"ipc://{workdir}/ack.sock")
        self.process = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(workdir,), daemon=True
        )
        self.process.start()
        for _ in range(3):
            if not self.ack.poll(120_000):
                raise RuntimeError("the engine process did not start")
            self.ack.recv()
        # Keeping no items: the rows above compare whole requests with their raw frames.
        self.sender = RequestSender(
            f"ipc://{workdir}/mmproc.sock", context=self.context, item_cache_bytes=0
        )
        # The default: an item the receiver acknowledged holding goes again by reference.
        self.ref_sender = RequestSender(f"ipc://{workdir}/mmproc.sock", context=self.context)
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect(f"ipc://{workdir}/raw.sock")
        self.push_codec = self.context.socket(zmq.PUSH)
        self.push_codec.connect(f"ipc://{workdir}/codec.sock")

    def round_trips(
        self, request: EngineRequest, tensors: list[torch.Tensor], budget_s: float
    ) -> RoundTrip:
        """Seconds per message for send -> receive (+ decode) -> ack: a whole request through
        mmproc's sender and receiver, the tensors alone through encode / decode, and each one's
        frames as raw ZMQ multipart messages. Batches of the four take turns in a rotating
        order, so that the load of a shared machine falls on all alike; each figure is the
        median of its batches."""
        request_frames = encode_request(request)  # the raw sides' bytes, encoded once, untimed
        codec_frames = encode(tensors)

        def request_trip() -> None:
            self.sender.send(request)
            self.ack.recv()

        def request_raw() -> None:
            self.push.send_multipart(request_frames, copy=False)
            self.ack.recv()

        def codec_trip() -> None:
            self.push_codec.send_multipart(encode(tensors), copy=False)
            self.ack.recv()

        def codec_raw() -> None:
            self.push.send_multipart(codec_frames, copy=False)
            self.ack.recv()

        trips = [request_trip, request_raw, codec_trip, codec_raw]
        # Batch size from a timed sample after a warm-up (a single trip would be dominated by
        # its own wake-up latency): 7 rounds of the 4 kinds share the budget.
        for trip in trips:
            for _ in range(_TRIP_WARM_UP):
                trip()
        start = time.perf_counter()
        for trip in trips:
            for _ in range(_TRIP_WARM_UP):
                trip()
        per_trip = max((time.perf_counter() - start) / (4 * _TRIP_WARM_UP), 1e-6)
        per_batch = max(10, int(budget_s / 28 / per_trip))
        timings: dict[Callable[[], None], list[float]] = {trip: [] for trip in trips}
        for round_ in range(7):
            for trip in trips[round_ % 4 :] + trips[: round_ % 4]:
                for _ in range(_TRIP_WARM_UP):
                    trip()  # untimed: the first trips after a switch of socket run cold
                start = time.perf_counter()
                for _ in range(per_batch):
                    trip()
                timings[trip].append((time.perf_counter() - start) / per_batch)
        return RoundTrip(*(statistics.median(timings[trip]) for trip in trips))

    def close(self) -> None:
        self.process.terminate()
        self.process.join()
        self.sender.close()
        self.ref_sender.close()
        self.push.close(linger=0)
        self.push_codec.close(linger=0)
        self.ack.close(linger=0)
        self.context.term()


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Row:
    nbytes: int
    count: int
    enc_aux: float
    enc_inline: float
    dec_aux: float
    dec_inline: float
    rss_enc_aux: float | None
    rss_enc_inline: float | None
    rss_dec_aux: float | None
    rss_dec_inline: float | None
    enc_request: float
    dec_request: float
    trip: RoundTrip
    memcpy: float


def measure(nbytes: int, count: int, budget_s: float, engine: Engine, quiet_s: float) -> Row:
    tensors = make_tensors(nbytes, count)
    total = nbytes * count
    inline = total + 1  # every tensor below the threshold
    aux_frames = encode(tensors)
    inline_frames = encode(tensors, threshold=inline)
    request = make_request(tensors)
    request_frames = encode_request(request)
    heavy = budget_s if total < 16 * MIB else budget_s / 2
    wait_until_quiet(quiet_s)
    row = Row(
        nbytes=nbytes,
        count=count,
        enc_aux=time_per_call(lambda: encode(tensors), budget_s=budget_s),
        enc_inline=time_per_call(lambda: encode(tensors, threshold=inline), budget_s=heavy),
        dec_aux=time_per_call(lambda: decode(aux_frames), budget_s=budget_s),
        dec_inline=time_per_call(lambda: decode(inline_frames, limits=BIG_LIMITS), budget_s=heavy),
        rss_enc_aux=added_peak_mib(lambda: encode(tensors)),
        rss_enc_inline=added_peak_mib(lambda: encode(tensors, threshold=inline)),
        rss_dec_aux=added_peak_mib(lambda: decode(aux_frames)),
        rss_dec_inline=added_peak_mib(lambda: decode(inline_frames, limits=BIG_LIMITS)),
        enc_request=time_per_call(lambda: encode_request(request), budget_s=budget_s),
        dec_request=time_per_call(lambda: decode_request(request_frames), budget_s=budget_s),
        trip=_after_quiet(quiet_s, lambda: engine.round_trips(request, tensors, 4 * budget_s)),
        memcpy=memcpy_seconds(total),
    )
    return row


def _after_quiet(quiet_s: float, fn: Callable[[], RoundTrip]) -> RoundTrip:
    wait_until_quiet(quiet_s)
    return fn()


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}" if seconds < 1e-3 else f"{seconds * 1e3:,.1f} ms"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _mbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:,.0f}"


def print_tables(rows: list[Row]) -> None:
    print("\nCodec (the tensors alone): time per request in us, added peak RSS in MiB")
    head = (
        f"{'tensors':>12} | {'enc aux':>9} {'enc inline':>11} | {'dec aux':>9} "
        f"{'dec inline':>11} | {'+RSS enc aux':>12} {'enc inl':>8} {'dec aux':>8} {'dec inl':>8}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        print(
            f"{row.count} x {_size(row.nbytes):>7} | {_us(row.enc_aux):>9} "
            f"{_us(row.enc_inline):>11} | {_us(row.dec_aux):>9} {_us(row.dec_inline):>11} | "
            f"{_mib(row.rss_enc_aux):>12} {_mib(row.rss_enc_inline):>8} "
            f"{_mib(row.rss_dec_aux):>8} {_mib(row.rss_dec_inline):>8}"
        )
    print(
        "\nipc:// round trips (send -> decode -> ack), us per message, each next to its own frames "
        "sent as raw ZMQ messages; MB/s of tensor bytes"
    )
    head = (
        f"{'tensors':>12} | {'codec':>9} {'raw':>9} {'ratio':>6} | {'enc req':>8} "
        f"{'dec req':>8} {'request':>9} {'raw':>9} {'ratio':>6} | {'request MB/s':>12} "
        f"{'raw MB/s':>9} {'memcpy MB/s':>11}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        total = row.nbytes * row.count
        trip = row.trip
        print(
            f"{row.count} x {_size(row.nbytes):>7} | {_us(trip.codec_s):>9} "
            f"{_us(trip.codec_raw_s):>9} {trip.codec_ratio:>6.2f} | {_us(row.enc_request):>8} "
            f"{_us(row.dec_request):>8} {_us(trip.request_s):>9} {_us(trip.request_raw_s):>9} "
            f"{trip.request_ratio:>6.2f} | {_mbps(total, trip.request_s):>12} "
            f"{_mbps(total, trip.request_raw_s):>9} {_mbps(total, row.memcpy):>11}"
        )
    print(
        "  codec: the tensors alone, encode() -> decode(), as the reference measured; request: a "
        "whole EngineRequest (schema, 64 tokens)\n  through RequestSender -> RequestReceiver."
    )


def print_verdict(rows: list[Row]) -> None:
    singles = [row for row in rows if row.count == 1]
    enc = [row.enc_aux * 1e6 for row in singles]
    dec = [row.dec_aux * 1e6 for row in singles]
    rss = [
        value for row in rows for value in (row.rss_enc_aux, row.rss_dec_aux) if value is not None
    ]

    def ratios(ratio: Callable[[RoundTrip], float], keep: Callable[[int], bool]) -> str:
        picked = [ratio(row.trip) for row in rows if keep(row.nbytes * row.count)]
        return f"{min(picked):.2f}..{max(picked):.2f}" if picked else "-"

    print("\nAgainst the targets (codec figures: 1 tensor per request):")
    print(
        f"  encode, aux frames: {min(enc):.1f}..{max(enc):.1f} us over "
        f"{_size(singles[0].nbytes)}..{_size(singles[-1].nbytes)} (target <= "
        f"{1.5 * REF_ENCODE_US:.1f} us, flat)"
    )
    print(
        f"  decode, aux frames: {min(dec):.1f}..{max(dec):.1f} us (target <= "
        f"{1.5 * REF_DECODE_US:.1f} us)"
    )
    if rss:
        print(f"  added peak RSS with aux frames: at most {max(rss):.1f} MiB (target: none)")
    for what, ratio in (
        ("codec (tensors alone)", lambda trip: trip.codec_ratio),
        ("whole request", lambda trip: trip.request_ratio),
    ):
        print(
            f"  ipc round trip / raw ZMQ frames, {what} (target <= 1.25): "
            f"{ratios(ratio, lambda n: n >= 16 * MIB)} for 16 MiB and more, "
            f"{ratios(ratio, lambda n: n < 16 * MIB)} below"
        )


@dataclass
class References:
    """Items by reference: a repeated 1024x768 Qwen2-VL image."""

    wire_full: int
    """Bytes on the wire of the request with its image in full (its first send)."""
    wire_ref: int
    """... of the same request again, its image by reference."""
    wire_none: int
    """... of the same request without media."""
    dec_full: float
    dec_full_keep: float
    """Decode of the full request, plus keying its item for the receiver's cache."""
    dec_ref: float
    """Decode of the request by reference, its item filled in from the cache."""
    dec_none: float
    enc_full: float
    enc_ref: float
    """What the sender does for a request by reference: key the item, encode without it."""
    trip_full: float
    trip_ref: float
    trip_none: float
    chat_full: int
    """Bytes of a 10-turn chat, one new image per turn, every image in every turn in full."""
    chat_ref: int
    """... with references: each image crosses once."""
    chat_refs: int
    chat_items_in_full: int


def _wire_bytes(sender: RequestSender, engine: Engine, request: EngineRequest) -> int:
    """Bytes ``request`` put on the wire, sent once and acknowledged."""
    before = sender.stats.bytes
    sender.send(request)
    engine.ack.recv()
    if not sender.flush(60):
        raise RuntimeError(f"request {request.request_id} was not acknowledged")
    return sender.stats.bytes - before


def _trip(sender: RequestSender, engine: Engine, request: EngineRequest, budget_s: float) -> float:
    def trip() -> None:
        sender.send(request)
        engine.ack.recv()

    return time_per_call(trip, budget_s=budget_s)


def measure_references(engine: Engine, budget_s: float, quiet_s: float) -> References:
    request, _ = make_qwen_request(seed=7)
    no_media = EngineRequest("bench", request.prompt_token_ids, [], request.params)
    full_frames = encode_request(request)
    kept = decode_request(full_frames).features[0]
    key = item_key(kept)
    cache = ItemCache(DEFAULT_ITEM_CACHE_BYTES)
    cache.keep(key, kept)
    ref_frames = encode_request(request, by_reference={key})
    none_frames = encode_request(no_media)
    feature = request.features[0]

    def decode_and_keep() -> None:
        item_key(decode_request(full_frames).features[0])

    wait_until_quiet(quiet_s)
    dec_none = time_per_call(lambda: decode_request(none_frames), budget_s=budget_s)
    dec_ref = time_per_call(lambda: decode_request(ref_frames, items=cache), budget_s=budget_s)
    dec_full = time_per_call(lambda: decode_request(full_frames), budget_s=budget_s)
    dec_full_keep = time_per_call(decode_and_keep, budget_s=budget_s)
    enc_full = time_per_call(lambda: encode_request(request), budget_s=budget_s)
    enc_ref = time_per_call(
        lambda: encode_request_refs(request, None, [item_key(feature)]), budget_s=budget_s
    )

    sender = engine.ref_sender
    wire_full = _wire_bytes(sender, engine, request)  # the first send of this image
    wire_ref = _wire_bytes(sender, engine, request)
    wire_none = _wire_bytes(sender, engine, no_media)
    wait_until_quiet(quiet_s)
    trip_ref = _trip(sender, engine, request, 4 * budget_s)
    trip_none = _trip(sender, engine, no_media, 4 * budget_s)
    trip_full = _trip(engine.sender, engine, request, 4 * budget_s)
    if not sender.flush(60):
        raise RuntimeError("the round trips by reference were not all acknowledged")

    # A 10-turn chat: turn t carries images 0..t-1 (new ones: seeds the receiver never saw).
    images = [make_qwen_request(seed=100 + turn)[0].features[0] for turn in range(10)]
    chats = {}
    for name, chat_sender in (("full", engine.sender), ("ref", sender)):
        before = chat_sender.stats
        for turn in range(1, 11):
            features = [
                WireFeature("image", index, f.hash, 1000 * index, f.length, None, f.data, f.norm)
                for index, f in enumerate(images[:turn])
            ]
            turn_request = EngineRequest(f"{name}-{turn}", list(range(1000 * turn + 24)), features)
            _wire_bytes(chat_sender, engine, turn_request)
        after = chat_sender.stats
        chats[name] = (
            after.bytes - before.bytes,
            after.items_by_reference - before.items_by_reference,
            after.items_in_full - before.items_in_full,
        )
    return References(
        wire_full=wire_full,
        wire_ref=wire_ref,
        wire_none=wire_none,
        dec_full=dec_full,
        dec_full_keep=dec_full_keep,
        dec_ref=dec_ref,
        dec_none=dec_none,
        enc_full=enc_full,
        enc_ref=enc_ref,
        trip_full=trip_full,
        trip_ref=trip_ref,
        trip_none=trip_none,
        chat_full=chats["full"][0],
        chat_ref=chats["ref"][0],
        chat_refs=chats["ref"][1],
        chat_items_in_full=chats["ref"][2],
    )


def print_references(refs: References) -> None:
    print(
        "\nItems by reference: one 1024x768 Qwen2-VL image (4.48 MiB), 1,024-token prompt; bytes "
        "on the wire (envelope included), us per request"
    )
    head = (
        f"{'request':>22} | {'wire bytes':>11} | {'encode':>8} | {'decode':>8} {'/ no media':>10}"
        f" | {'ipc RTT':>9}"
    )
    print(head)
    print("-" * len(head))
    rows = (
        ("image in full", refs.wire_full, refs.enc_full, refs.dec_full, refs.trip_full),
        ("image by reference", refs.wire_ref, refs.enc_ref, refs.dec_ref, refs.trip_ref),
        ("no media", refs.wire_none, None, refs.dec_none, refs.trip_none),
    )
    for name, wire, enc, dec, trip in rows:
        print(
            f"{name:>22} | {wire:>11,} | {'-' if enc is None else _us(enc):>8} | {_us(dec):>8} "
            f"{dec / refs.dec_none:>10.2f} | {_us(trip):>9}"
        )
    print(
        f"  the repeated image costs {refs.wire_ref - refs.wire_none} bytes on the wire (target <= "
        f"256); decode by reference / no media: {refs.dec_ref / refs.dec_none:.2f} (target <= 2)"
    )
    print(
        f"  receiver, first send: decode {_us(refs.dec_full)} + keying the item "
        f"{_us(refs.dec_full_keep - refs.dec_full)}; sender by reference: keying + encode "
        f"{_us(refs.enc_ref)}"
    )
    print(
        f"  10-turn chat, one new image per turn: {refs.chat_full / MIB:,.1f} MiB every image in "
        f"every turn, {refs.chat_ref / MIB:,.1f} MiB by reference ({refs.chat_items_in_full} "
        f"images in full, {refs.chat_refs} by reference)"
    )


PROMPT_LENGTHS = [64, 1024, 16384, 131072]


def print_prompt_lengths(budget_s: float) -> None:
    """encode_request / decode_request of requests that are all prompt (no features): what the
    token ids cost as the prompt grows (they travel as one int64 array)."""
    print("\nPrompt length alone (no features): us per request")
    print(f"{'tokens':>8} | {'encode':>9} {'decode':>9} | {'ns/token enc':>12} {'dec':>6}")
    for length in PROMPT_LENGTHS:
        rng = torch.Generator().manual_seed(length)
        ids = torch.randint(0, 151_000, (length,), generator=rng).tolist()
        request = EngineRequest("bench", ids)
        frames = encode_request(request)
        enc = time_per_call(lambda r=request: encode_request(r), budget_s=budget_s)
        dec = time_per_call(lambda f=frames: decode_request(f), budget_s=budget_s)
        print(
            f"{length:>8} | {_us(enc):>9} {_us(dec):>9} | {enc / length * 1e9:>12.1f} "
            f"{dec / length * 1e9:>6.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 1 MiB, short budgets")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each measurement, wait up to S seconds for the machine to go quiet",
    )
    args = parser.parse_args()
    sizes = [size for size in SIZES if size <= MIB] if args.quick else SIZES
    budget_s = 0.1 if args.quick else 0.4
    torch.set_num_threads(1)  # memcpy baseline on one core, like the codec and ZMQ's copies
    rows = []
    jiffies_before = _cpu_jiffies()
    with tempfile.TemporaryDirectory(prefix="mmproc-wire-") as workdir:
        engine = Engine(workdir)
        try:
            for count in COUNTS:
                for nbytes in sizes:
                    rows.append(measure(nbytes, count, budget_s, engine, args.wait_quiet))
                    print(f"  measured {count} x {_size(nbytes)}", flush=True)
            qwen_request, qwen_tensors = make_qwen_request()
            qwen_trip = _after_quiet(
                args.wait_quiet,
                lambda: engine.round_trips(qwen_request, qwen_tensors, 4 * budget_s),
            )
            references = measure_references(engine, budget_s, args.wait_quiet)
        finally:
            engine.close()
    jiffies_after = _cpu_jiffies()
    print_tables(rows)
    print(
        "\nA real request: one 1024x768 image as Qwen2-VL uint8 patches (4.48 MiB), 1,024-token "
        f"prompt:\n  request RTT {_us(qwen_trip.request_s)} vs raw {_us(qwen_trip.request_raw_s)}"
        f" (ratio {qwen_trip.request_ratio:.2f}); codec RTT {_us(qwen_trip.codec_s)} vs raw "
        f"{_us(qwen_trip.codec_raw_s)} (ratio {qwen_trip.codec_ratio:.2f})"
    )
    print_references(references)
    print_prompt_lengths(budget_s)
    print_verdict(rows)
    if jiffies_before is not None and jiffies_after is not None:
        busy = (jiffies_after[0] - jiffies_before[0]) / max(1, jiffies_after[1] - jiffies_before[1])
        print(
            f"\n{os.cpu_count()} CPUs, {100 * busy:.0f}% busy over the run (this benchmark and "
            "anything else running on the machine)."
        )


if __name__ == "__main__":
    main()
