"""The hardened decoder: known attacks one by one, then property-based fuzzing (hypothesis).

Whatever bytes arrive, `decode` either returns a value or raises `DecodeError`: never another
exception, never a hang, never an allocation beyond a small multiple of the message. Decoded
tensors are views over the frames (or empty), so "no large allocation" is checked two ways:
tracemalloc for the Python side (parse, lists, bytes) and, for tensors, that each one's memory
lies inside a received frame or is empty.
"""

from __future__ import annotations

import signal
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from mmproc.errors import DecodeError, EncodeError
from mmproc.wire import (
    SCHEMA_VERSION,
    DecodeLimits,
    EngineRequest,
    ItemCache,
    WireFeature,
    decode,
    decode_request,
    encode,
    encode_request,
    item_key,
)

FUZZ = settings(
    max_examples=150,
    deadline=None,  # no timing assertions: the machine is shared; the watchdog catches hangs
    suppress_health_check=[HealthCheck.too_slow],
)

# A decode that runs this long (seconds) is a hang, whatever the machine's load.
WATCHDOG = 60


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    def hung(signum: int, frame: Any) -> None:
        raise AssertionError(f"a test in {__name__} ran past the {WATCHDOG} s watchdog: a hang")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(WATCHDOG)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def frame_spans(frames: list[Any]) -> list[tuple[int, int]]:
    spans = []
    for frame in frames:
        view = np.frombuffer(frame, dtype=np.uint8)
        start = view.ctypes.data
        spans.append((start, start + view.nbytes))
    return spans


def check_result(value: Any, frames: list[Any]) -> None:
    """Every tensor in a decoded value is empty, or small and inline, or lies inside a frame."""
    spans = frame_spans(frames)
    total = sum(end - start for start, end in spans)

    def visit(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            nbytes = node.numel() * node.element_size()
            assert nbytes <= total
            if nbytes:
                start = node.data_ptr()
                inside = any(lo <= start and start + nbytes <= hi for lo, hi in spans)
                assert inside or nbytes <= spans[0][1] - spans[0][0]  # inline: from frame 0
        elif isinstance(node, np.ndarray):
            assert node.nbytes <= total and not node.flags.writeable
        elif isinstance(node, list):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            for item in node.values():
                visit(item)

    visit(value)


def decode_or_reject(frames: list[Any], limits: DecodeLimits | None = None) -> Any:
    """decode(), where DecodeError is a fine outcome and anything else fails the test."""
    try:
        value = decode(frames, limits=limits)
    except DecodeError:
        return None
    check_result(value, frames)
    return value


def python_peak(frames: list[Any], limits: DecodeLimits | None = None) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            decode(frames, limits=limits)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def tensor_msg(dtype: str, shape: list[Any], data: Any) -> bytes:
    return msgpack.packb([dtype, shape, data])


# --- known attacks --------------------------------------------------------------------------------

RAW = msgpack.ExtType(3, bytes(8))


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no frames"),
        (None, "sequence of buffers"),
        (["text"], "frame 0 is a str"),
        ([b"\xc1"], "not a valid msgpack body"),
        ([b"\x92\x01"], "not a valid msgpack body"),  # truncated
        ([b"\x01\x02"], "not a valid msgpack body"),  # trailing bytes
        ([b"\xa2\xff\xfe"], "not a valid msgpack body"),  # invalid utf-8
        ([msgpack.packb(msgpack.ExtType(1, b"cos\nsystem\n"))], r"ext type 1 \(pickle"),
        ([msgpack.packb(msgpack.ExtType(2, b""))], r"ext type 2 \(cloudpickle"),
        ([msgpack.packb(msgpack.ExtType(42, b""))], "ext type 42"),
        ([msgpack.packb(msgpack.Timestamp(1, 0))], "timestamp"),
        ([msgpack.packb({1: 2})], "not a valid msgpack body"),  # int map key
        ([msgpack.packb({b"k": 2})], "map key b'k' is bytes"),
        ([msgpack.packb([RAW])], r"at \$\[0\]: ext type 3 .* outside a tensor"),
        ([tensor_msg("float32", [2], RAW)], "float32"),  # matches: 8 bytes = 2 floats
        ([tensor_msg("float32", [3], RAW)], r"needs 12 bytes but its inline bytes holds 8"),
        ([tensor_msg("float32", [2], 0)], "frame 0"),
        ([tensor_msg("float32", [2], 1)], "refers to frame 1"),
        ([tensor_msg("float32", [2], 2), bytes(8)], "refers to frame 2"),
        ([tensor_msg("float32", [2], -1), bytes(8)], "refers to frame -1"),
        ([msgpack.packb([["uint8", [8], 1], ["uint8", [8], 1]]), bytes(8)], "more than one"),
        ([msgpack.packb(None), bytes(8)], r"frames \[1\] are not referenced"),
        ([tensor_msg("|O", [1], RAW)], "'|O' is not allowed"),
        ([tensor_msg("<U2", [1], RAW)], "'<U2' is not allowed"),
        ([tensor_msg("object", [1], RAW)], "'object' is not a known dtype"),
        ([tensor_msg("complex64", [1], RAW)], "'complex64' is not allowed"),
        ([tensor_msg("bool", [2], msgpack.ExtType(3, b"\x01\x02"))], "other than 0 and 1"),
        ([tensor_msg("|b1", [1], msgpack.ExtType(3, b"\xff"))], "other than 0 and 1"),
        ([tensor_msg("uint8", [-8], RAW)], "has a dimension -8"),
        ([tensor_msg("uint8", [2.0, 4], RAW)], "has a dimension 2.0"),
        ([tensor_msg("uint8", [True, 8], RAW)], "has a dimension True"),
        ([tensor_msg("uint8", [[8]], RAW)], r"has a dimension \[8\]"),
        ([tensor_msg("uint8", [2**62, 2**62], RAW)], "too large to represent"),
        ([tensor_msg("uint8", [0, 2**64 - 1], msgpack.ExtType(3, b""))], "too large"),
        ([tensor_msg("uint8", [1] * 33, RAW)], "33 dimensions"),
        ([b"\x91" * 40 + b"\xc0"], "nested deeper than 32"),
        ([b"\x91" * 5000 + b"\xc0"], "nested deeper than 32"),  # refused as it is read
    ],
)
def test_malformed_messages_raise_decode_error(frames: Any, match: str) -> None:
    if match == "float32":  # the one well-formed message in the table
        assert decode(frames).tolist() == [0.0, 0.0]
        return
    with pytest.raises(DecodeError, match=match):
        decode(frames)


def test_limits_on_frames_bytes_and_body() -> None:
    limits = DecodeLimits(max_frames=3, max_total_bytes=100, max_body_bytes=10)
    with pytest.raises(DecodeError, match="4 frames, more than the limit of 3"):
        decode([b"\xc0", b"", b"", b""], limits=limits)
    with pytest.raises(DecodeError, match="larger than the limit of 100 bytes"):
        decode([b"\xc0", bytes(60), bytes(60)], limits=limits)
    with pytest.raises(DecodeError, match="has 11 bytes, more than the limit of 10"):
        decode([msgpack.packb("x" * 10)], limits=limits)


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd\xff\xff\xff\xff",  # array of 2**32-1 elements, none present
        b"\xdf\xff\xff\xff\xff",  # map of 2**32-1 pairs
        b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
        b"\xc9\xff\xff\xff\xff\x03",  # ext 3 of 4 GiB
        msgpack.packb(["float32", [1 << 30, 1 << 30], RAW]),  # 4 EiB tensor claim
        msgpack.packb(["uint8", [1 << 40], 1]),  # 1 TiB claim on a missing frame
    ],
)
def test_size_claims_allocate_nothing(body: bytes) -> None:
    assert python_peak([body]) < 64 * 1024


def test_container_flood_is_cut_off_early() -> None:
    count = 200_000
    body = b"\xdd" + struct.pack(">I", count) + b"\x90" * count
    limits = DecodeLimits(max_containers=1000)
    with pytest.raises(DecodeError, match="more than 1000 arrays and maps"):
        decode([body], limits=limits)
    # The outer list's slots (8 bytes each) are the only allocation proportional to the body.
    assert python_peak([body], limits) < 8 * count + 256 * 1024


@pytest.mark.parametrize("containers", [1, 11, 200])
def test_container_limit_is_exact_at_the_boundary(containers: int) -> None:
    # n nested arrays take n bytes: at the limit the body is small enough for the decoder to skip
    # counting, one over the limit it counts, and must still refuse.
    body = b"\x91" * (containers - 1) + b"\x90"
    limits = DecodeLimits(max_containers=containers, max_depth=256)
    assert len(body) == containers
    nested = decode([body], limits=limits)
    for _ in range(containers - 1):
        (nested,) = nested
    assert nested == []
    if containers > 1:
        fewer = DecodeLimits(max_containers=containers - 1, max_depth=256)
        with pytest.raises(DecodeError, match=f"more than {containers - 1} arrays and maps"):
            decode([body], limits=fewer)


# --- what a body may cost: the memory budget ---------------------------------------------------

KIB = 1024


def request_body(params_value: bytes) -> bytes:
    """The body of an engine request whose params hold one raw msgpack value, written byte by
    byte so that it can be anything a parser must survive."""
    head = msgpack.packb(
        {
            "schema_version": SCHEMA_VERSION,
            "request_id": "r",
            "prompt_token_ids": ["<i8", [1], msgpack.ExtType(3, bytes(8))],
            "features": [],
            "prompt_outputs": {},
        }
    )
    # head holds 5 of the 6 keys: a 6-entry map header, params last
    return b"\x86" + head[1:] + msgpack.packb("params") + b"\x81\xa1x" + params_value


def chunked(item: bytes, size: int, per_chunk: int = 1000) -> bytes:
    """An array of arrays of ``per_chunk`` copies of ``item``, about ``size`` bytes in all: each
    array claims no more than the bytes that follow it, and costs what its items cost."""
    chunk = b"\xdc" + struct.pack(">H", per_chunk) + item * per_chunk
    count = max(1, size // len(chunk))
    return b"\xdd" + struct.pack(">I", count) + chunk * count


# One byte (or a few) of body each, and far more in memory as Python objects.
AMPLIFIERS = {
    "empty arrays": b"\x90",
    "empty maps": b"\x80",
    "one-entry maps": b"\x81\xa0\xc0",
    "ints -32..-6": b"\xf0",
    "two-char strings": b"\xa2ab",
    "non-latin-1 chars": b"\xa2\xc4\x80",
    "floats": b"\xca\x3f\x80\x00\x01",
    "nils": b"\xc0",
    "tiny tensors": b"\x93\xa5uint8\x91\x01\xd4\x03\x00",
}


@pytest.mark.parametrize("size", [4 * KIB, 256 * KIB])
@pytest.mark.parametrize("item", AMPLIFIERS.values(), ids=list(AMPLIFIERS))
def test_a_body_of_tiny_values_allocates_no_more_than_its_budget(item: bytes, size: int) -> None:
    body = request_body(chunked(item, size))
    limits = DecodeLimits()
    tracemalloc.start()
    try:
        try:
            decode_request([body], limits=limits)
        except DecodeError as exc:
            assert "bytes of objects" in str(exc), exc  # refused for what it would cost
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The budget charges every object before it exists, at an upper bound of its size.
    assert peak <= max(limits.max_memory_ratio * len(body), limits.memory_allowance)


def test_a_request_that_is_not_a_map_is_refused_before_its_body_is_parsed() -> None:
    count = 4 << 20
    body = b"\xdd" + struct.pack(">I", count) + b"\x90" * count  # 4 Mi empty arrays
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="engine request must be a map, got a msgpack array"):
            decode_request([body])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * KIB


def test_the_values_of_a_body_are_counted() -> None:
    limits = DecodeLimits(max_objects=1000)
    with pytest.raises(DecodeError, match="more than 1000 values"):
        decode_request([request_body(chunked(b"\xc0", 4 * KIB, per_chunk=100))], limits=limits)
    # An array claiming more items than values are left is refused before its slots exist.
    claim = request_body(b"\xdd" + struct.pack(">I", 1 << 20) + b"\xc0" * (1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="more than 1000 values"):
            decode_request([claim], limits=limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * KIB


def test_a_map_key_must_be_a_string_when_read_value_by_value() -> None:
    body = request_body(chunked(b"\x81\x01\xc0", 64 * KIB))  # maps keyed by the int 1
    with pytest.raises(DecodeError, match="map key 0 is a msgpack int"):
        decode_request([body])


# --- property-based fuzzing -----------------------------------------------------------------------

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.bfloat16, torch.float32]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int16, np.float16, np.float64]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor | np.ndarray:
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.integers(0, 2, size=shape) if draw(st.booleans()) else rng.normal(size=shape)
    if draw(st.booleans()):
        tensor = torch.from_numpy(np.asarray(values)).to(draw(st.sampled_from(TORCH_DTYPES)))
        if tensor.dim() >= 2 and draw(st.booleans()):
            tensor = tensor.transpose(0, 1)  # non-contiguous
        return tensor
    return np.asarray(values).astype(draw(st.sampled_from(NUMPY_DTYPES)))


plain = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=24)
)
values = st.recursive(
    plain | tensors(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=10,
)
thresholds = st.sampled_from([0, 8, 256, 1 << 30])


def encode_or_reject(value: Any, threshold: int) -> list[Any]:
    try:
        return encode(value, threshold=threshold)
    except EncodeError as exc:
        # Random text can spell a dtype name inside a [str, list, int] list: rightly refused.
        assert "form of an encoded tensor" in str(exc)
        reject()


def same(got: Any, expected: Any) -> bool:
    if isinstance(expected, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == expected.dtype
            and got.shape == expected.shape
            and bool(torch.equal(got.contiguous().view(-1), expected.contiguous().view(-1)))
        )
    if isinstance(expected, np.ndarray):
        return (
            type(got) is np.ndarray
            and got.dtype == expected.dtype
            and got.tobytes() == expected.tobytes()
            and got.shape == expected.shape
        )
    if isinstance(expected, list):
        return type(got) is list and len(got) == len(expected) and all(map(same, got, expected))
    if isinstance(expected, dict):
        return (
            type(got) is dict
            and list(got) == list(expected)
            and all(same(got[k], expected[k]) for k in expected)
        )
    return type(got) is type(expected) and got == expected


@FUZZ
@given(value=values, threshold=thresholds)
def test_valid_values_round_trip(value: Any, threshold: int) -> None:
    frames = encode_or_reject(value, threshold)
    assert same(decode(frames), value)
    # what went over the wire can be decoded from plain bytes too
    assert same(decode([bytes(frame) for frame in frames]), value)


def values_in(tree: Any) -> int:
    """How many msgpack values a raw tree holds (map keys included)."""
    if isinstance(tree, list):
        return 1 + sum(map(values_in, tree))
    if isinstance(tree, dict):
        return 1 + sum(values_in(key) + values_in(value) for key, value in tree.items())
    return 1


@FUZZ
@given(value=values, threshold=thresholds)
def test_a_body_read_value_by_value_decodes_as_one_read_whole(value: Any, threshold: int) -> None:
    frames = encode_or_reject(value, threshold)
    body = frames[0]
    count = values_in(msgpack.unpackb(body, strict_map_key=False))
    if count >= len(body):
        reject()  # every value one byte: no limit below the body's size lets it through
    # A limit on values below the body's size rules out the one-call parse.
    limits = DecodeLimits(max_objects=len(body) - 1)
    assert same(decode(frames, limits=limits), value)
    assert same(decode([bytes(frame) for frame in frames], limits=limits), value)


@FUZZ
@given(frames=st.lists(st.binary(max_size=48), min_size=1, max_size=4))
def test_random_bytes_only_ever_raise_decode_error(frames: list[bytes]) -> None:
    decode_or_reject(frames)


DIMS_SMALL = st.integers(-1, 4) | st.sampled_from([2**62, 2**64 - 1])
INTERESTING = [0x00, 0x01, 0x7F, 0x80, 0x90, 0xC1, 0xC7, 0xC9, 0xCF, 0xD3, 0xDD, 0xDF, 0xFF]


def mutate(draw: st.DrawFn, encoded: list[Any]) -> list[bytes]:
    """Damage a valid message: flip and poke bytes, cut, insert, drop, duplicate, swap, append."""
    frames = [bytearray(frame) for frame in encoded]
    for _ in range(draw(st.integers(1, 4))):
        target = draw(st.integers(0, len(frames) - 1))
        frame = frames[target]
        action = draw(
            st.sampled_from(
                ["flip", "poke", "truncate", "insert", "drop", "duplicate", "swap", "append"]
            )
        )
        if action in ("flip", "poke") and frame:
            at = draw(st.integers(0, len(frame) - 1))
            if action == "flip":
                frame[at] ^= 1 << draw(st.integers(0, 7))
            else:
                frame[at] = draw(st.sampled_from(INTERESTING))
        elif action == "truncate":
            del frame[draw(st.integers(0, len(frame))) :]
        elif action == "insert":
            at = draw(st.integers(0, len(frame)))
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif action == "drop" and len(frames) > 1:
            del frames[target]
        elif action == "duplicate":
            frames.append(bytearray(frame))
        elif action == "swap" and len(frames) > 1:
            other = draw(st.integers(0, len(frames) - 1))
            frames[target], frames[other] = frames[other], frames[target]
        elif action == "append":
            frames.append(bytearray(draw(st.binary(max_size=32))))
    return [bytes(frame) for frame in frames]


@st.composite
def mutated_messages(draw: st.DrawFn) -> list[bytes]:
    return mutate(draw, encode_or_reject(draw(values), draw(thresholds)))


@FUZZ
@given(frames=mutated_messages())
def test_mutated_valid_messages_only_ever_raise_decode_error(frames: list[bytes]) -> None:
    decode_or_reject(frames)


# --- the request decoder reads the raw tree itself: fuzz it on its own ------------------------


@st.composite
def engine_requests(draw: st.DrawFn) -> EngineRequest:
    ids = draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=40))
    features = []
    for index in range(draw(st.integers(0, 3))):
        length = draw(st.integers(0, min(3, len(ids))))
        offset = draw(st.integers(0, len(ids) - length))
        data = {
            key: torch.from_numpy(np.arange(draw(st.integers(0, 80)), dtype=np.float32))
            for key in draw(st.lists(st.sampled_from(["pixel_values", "grid", "x"]), unique=True))
        }
        features.append(
            WireFeature(
                modality=draw(st.sampled_from(["image", "video", "audio"])),
                item_index=index,
                hash=draw(st.text(max_size=8)),
                offset=offset,
                length=length,
                is_embed=draw(st.none() | st.just(torch.ones(length, dtype=torch.bool))),
                data=data,
                norm=draw(st.none() | st.just({"mean": [0.5, 0.5], "scale": 1 / 255, "n": 3})),
            )
        )
    params = draw(st.dictionaries(st.text(max_size=5), plain | tensors(), max_size=3))
    return EngineRequest(draw(st.text(min_size=1, max_size=8)), ids, features, params)


def request_or_reject(request: EngineRequest, threshold: int) -> list[Any]:
    try:
        return encode_request(request, threshold=threshold)
    except EncodeError as exc:
        assert "form of an encoded tensor" in str(exc)
        reject()


def decode_request_or_reject(frames: list[Any]) -> EngineRequest | None:
    try:
        request = decode_request(frames)
    except DecodeError:
        return None
    tensors_in = [feature.is_embed for feature in request.features if feature.is_embed is not None]
    for feature in request.features:
        tensors_in.extend(feature.data.values())
    check_result(tensors_in, frames)
    return request


@FUZZ
@given(request=engine_requests(), threshold=thresholds)
def test_requests_round_trip(request: EngineRequest, threshold: int) -> None:
    got = decode_request(request_or_reject(request, threshold))
    assert got.request_id == request.request_id
    assert got.prompt_token_ids == request.prompt_token_ids
    assert len(got.features) == len(request.features)
    for g, e in zip(got.features, request.features):
        assert same(g.data, e.data) and g.norm == e.norm and g.hash == e.hash
    assert same(got.params, request.params)


@st.composite
def mutated_requests(draw: st.DrawFn) -> list[bytes]:
    return mutate(draw, request_or_reject(draw(engine_requests()), draw(thresholds)))


@FUZZ
@given(frames=mutated_requests())
def test_mutated_requests_only_ever_raise_decode_error(frames: list[bytes]) -> None:
    decode_request_or_reject(frames)


@st.composite
def mutated_requests_by_reference(draw: st.DrawFn) -> list[bytes]:
    request = draw(engine_requests())
    keys = {item_key(feature) for feature in request.features}
    try:
        frames = encode_request(request, threshold=draw(thresholds), by_reference=keys)
    except EncodeError as exc:
        assert "form of an encoded tensor" in str(exc)
        reject()
    return mutate(draw, frames)


@FUZZ
@given(frames=mutated_requests_by_reference())
def test_mutated_requests_by_reference_only_ever_raise_decode_error(frames: list[bytes]) -> None:
    items = ItemCache(1 << 20)
    try:
        request = decode_request(frames, items=items)
    except DecodeError:  # MissingItemsError among them: nothing is held
        return
    assert all(feature.data is not None for feature in request.features)


JUNK = (
    plain
    | st.sampled_from([-1, 2**63, 2**64 - 1, True, [], {}, [[[]]], {"k": []}])
    | st.builds(msgpack.ExtType, st.sampled_from([1, 3, 5]), st.binary(max_size=16))
    | st.tuples(
        st.sampled_from(["float32", "bool", "|O", "x"]), st.lists(DIMS_SMALL), st.integers(-1, 4)
    )
    | st.lists(plain, max_size=4)
    | st.dictionaries(st.text(max_size=3) | st.binary(max_size=3), plain, max_size=3)
)


def _slots(tree: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) place in a raw msgpack tree."""
    places: list[tuple[Any, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        keys = range(len(node)) if isinstance(node, list) else list(node)
        for key in keys:
            places.append((node, key))
            if isinstance(node[key], (list, dict)):
                stack.append(node[key])
    return places


@st.composite
def adversarial_requests(draw: st.DrawFn) -> list[bytes]:
    """Valid requests with values swapped for junk at random places of the raw msgpack tree:
    wrong types, tensor claims where none belong, junk where tensors must be, odd keys."""
    frames = request_or_reject(draw(engine_requests()), draw(thresholds))
    tree = msgpack.unpackb(frames[0])
    places = _slots(tree)
    for _ in range(draw(st.integers(1, 3))):
        node, key = draw(st.sampled_from(places))
        if isinstance(node, dict) and draw(st.booleans()):
            node[draw(st.text(max_size=4) | st.binary(max_size=3))] = draw(JUNK)
        else:
            node[key] = draw(JUNK)
    try:
        body = msgpack.packb(tree)
    except (TypeError, ValueError):
        reject()
    return [body, *(bytes(frame) for frame in frames[1:])]


@FUZZ
@given(frames=adversarial_requests())
def test_adversarial_requests_only_ever_raise_decode_error(frames: list[bytes]) -> None:
    decode_request_or_reject(frames)


DTYPE_NAMES = ["float32", "bfloat16", "bool", "uint8", "int64", "complex64", "float8_e5m2"]
DTYPE_NAMES += ["<f4", "|u1", "|b1", ">f4", "|O", "<U3", "<M8", "|V4", "=f4", "f4", "", "x"]
DIMS = st.integers(0, 4) | st.sampled_from([-1, 2**31, 2**62, 2**63, 2**64 - 1])


@st.composite
def adversarial_trees(draw: st.DrawFn) -> list[Any]:
    """Messages built at the msgpack level, aimed at the tensor path the random bytes rarely
    reach: plausible and implausible dtypes, shapes, ext payloads and frame indices."""
    aux = draw(st.lists(st.binary(max_size=40), max_size=3))
    shape = draw(
        st.lists(DIMS, max_size=4) | st.lists(st.none() | st.floats() | st.text(max_size=2))
    )
    data = draw(
        st.builds(msgpack.ExtType, st.sampled_from([3, 3, 3, 1, 2, 7]), st.binary(max_size=40))
        | st.integers(-2, len(aux) + 1)
        | st.booleans()
        | st.none()
    )
    node: Any = [draw(st.sampled_from(DTYPE_NAMES) | st.text(max_size=6)), shape, data]
    for _ in range(draw(st.integers(0, 3))):
        node = draw(st.sampled_from([lambda n: [n], lambda n: {"k": n}, lambda n: [1, n, "s"]]))(
            node
        )
    try:
        body = msgpack.packb(node)
    except (TypeError, ValueError):
        reject()
    return [body, *aux]


@FUZZ
@given(frames=adversarial_trees())
def test_adversarial_tensor_claims_only_ever_raise_decode_error(frames: list[bytes]) -> None:
    decode_or_reject(frames)


@settings(max_examples=40, deadline=None)
@given(frames=adversarial_trees())
def test_adversarial_messages_allocate_little(frames: list[bytes]) -> None:
    total = sum(len(frame) for frame in frames)
    tracemalloc.start()
    try:
        decode_or_reject(frames)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 + 64 * total
