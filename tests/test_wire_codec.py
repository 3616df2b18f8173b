"""The codec: byte-exact layout, zero copy both ways, the threshold, and what cannot be encoded."""

from __future__ import annotations

import enum
import gc
import struct
import warnings
from collections import OrderedDict
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from mmproc.errors import ConfigurationError, DecodeError, EncodeError
from mmproc.wire import (
    DEFAULT_THRESHOLD,
    THRESHOLD_ENV,
    DecodeLimits,
    decode,
    encode,
    zero_copy_threshold,
)


def address(buffer: Any) -> int:
    """Address of the first byte of a buffer (bytes, bytearray, memoryview, zmq.Frame)."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def raw(value: torch.Tensor | np.ndarray) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(value).tobytes()


def assert_same(got: Any, expected: Any) -> None:
    """Structural equality where tensors compare by type, dtype, shape and exact bytes."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert raw(got) == raw(expected)
    elif isinstance(expected, np.ndarray):
        assert type(got) is np.ndarray
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert raw(got) == raw(expected)
    elif isinstance(expected, (list, tuple)):
        assert type(got) is list and len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_same(g, e)
    elif isinstance(expected, dict):
        assert type(got) is dict and list(got) == list(expected)
        for key in expected:
            assert_same(got[key], expected[key])
    else:
        assert type(got) is type(expected) and got == expected


# --- layout, byte for byte ------------------------------------------------------------------


def test_small_tensor_is_inline_ext3_byte_for_byte() -> None:
    frames = encode(torch.tensor([1, 2], dtype=torch.uint8))
    # fixarray(3): fixstr "uint8", fixarray(1) [2], fixext2 type 3 bytes 01 02
    assert frames == [b"\x93\xa5uint8\x91\x02\xd5\x03\x01\x02"]


def test_large_tensor_is_frame_index_byte_for_byte() -> None:
    tensor = torch.tensor([1, 2], dtype=torch.uint8)
    frames = encode(tensor, threshold=0)
    assert frames[0] == b"\x93\xa5uint8\x91\x02\x01"
    assert len(frames) == 2 and bytes(frames[1]) == b"\x01\x02"


def test_float32_matrix_uses_fixext16_with_c_order_bytes() -> None:
    tensor = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    (body,) = encode(tensor)
    payload = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    assert body == b"\x93\xa7float32\x92\x02\x02\xd8\x03" + payload


def test_odd_and_larger_inline_sizes_use_ext8_and_ext16() -> None:
    (body,) = encode(torch.tensor([7, 8, 9], dtype=torch.int8))
    assert body == b"\x93\xa4int8\x91\x03\xc7\x03\x03\x07\x08\x09"
    (body,) = encode(torch.zeros(300, dtype=torch.uint8), threshold=1000)
    assert body == b"\x93\xa5uint8\x91\xcd\x01\x2c\xc8\x01\x2c\x03" + bytes(300)


def test_bfloat16_and_bool_and_scalar_names() -> None:
    (body,) = encode(torch.tensor(1.0, dtype=torch.bfloat16))
    # shape [] is an empty fixarray; bf16 1.0 is 0x3f80, little-endian
    assert body == b"\x93\xa8bfloat16\x90\xd5\x03\x80\x3f"
    (body,) = encode(torch.tensor([True, False]))
    assert body == b"\x93\xa4bool\x91\x02\xd5\x03\x01\x00"


def test_numpy_array_carries_dtype_str_with_byte_order() -> None:
    (body,) = encode(np.array([1.0], dtype=np.float32))
    assert body == b"\x93\xa3<f4\x91\x01\xd6\x03\x00\x00\x80\x3f"
    (body,) = encode(np.array([True]))
    assert body == b"\x93\xa3|b1\x91\x01\xd4\x03\x01"


def test_plain_values_are_plain_msgpack() -> None:
    (body,) = encode({"a": [1, None, True, 1.5, "x", b"\x00"]})
    assert body == (
        b"\x81\xa1a\x96\x01\xc0\xc3\xcb" + struct.pack(">d", 1.5) + b"\xa1x\xc4\x01\x00"
    )
    assert body == msgpack.packb({"a": [1, None, True, 1.5, "x", b"\x00"]})


def test_threshold_boundary_is_below_inline_at_or_above_frame() -> None:
    threshold = 64
    below = torch.full((threshold - 1,), 1, dtype=torch.uint8)
    at = torch.full((threshold,), 2, dtype=torch.uint8)
    above = torch.full((threshold + 1,), 3, dtype=torch.uint8)
    frames = encode([below, at, above], threshold=threshold)
    tree = msgpack.unpackb(frames[0])
    assert isinstance(tree[0][2], msgpack.ExtType) and tree[0][2].code == 3
    assert tree[1][2] == 1 and tree[2][2] == 2
    assert len(frames) == 3


def test_aux_frames_are_numbered_in_wire_order_through_nesting() -> None:
    small = torch.ones(4, dtype=torch.uint8)
    first = torch.full((300,), 2, dtype=torch.uint8)
    second = torch.full((400,), 3, dtype=torch.uint8)
    frames = encode({"inline": small, "nested": [7, first], "later": {"is_embed": second}})
    tree = msgpack.unpackb(frames[0])
    assert tree["inline"][2] == msgpack.ExtType(3, b"\x01" * 4)
    assert tree["nested"] == [7, ["uint8", [300], 1]]
    assert tree["later"]["is_embed"] == ["uint8", [400], 2]
    assert address(frames[1]) == first.data_ptr()
    assert address(frames[2]) == second.data_ptr()


def test_decodes_a_message_written_by_another_implementation() -> None:
    # vLLM's serializer writes the same layout; these bytes are assembled by hand from the spec.
    payload = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    body = (
        b"\x92"
        + b"\x93\xa7float32\x92\x02\x02\x01"
        + b"\x93\xa3<i8\x91\x01\xd7\x03"
        + (struct.pack("<q", -5))
    )
    tensor, array = decode([body, payload])
    assert isinstance(tensor, torch.Tensor) and tensor.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert isinstance(array, np.ndarray) and array.dtype == np.int64 and array.tolist() == [-5]


# --- round trips --------------------------------------------------------------------------------

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("threshold", [0, 10**9])
def test_torch_dtypes_round_trip(dtype: torch.dtype, threshold: int) -> None:
    tensor = (torch.arange(24) % 7).reshape(2, 3, 4).to(dtype)
    got = decode(encode(tensor, threshold=threshold))
    assert_same(got, tensor)


@pytest.mark.parametrize(
    "dtype", [np.bool_, np.uint8, np.int16, np.uint32, np.int64, np.float16, np.float64]
)
@pytest.mark.parametrize("threshold", [0, 10**9])
def test_numpy_dtypes_round_trip(dtype: type, threshold: int) -> None:
    array = (np.arange(12) % 5).astype(dtype).reshape(3, 4)
    got = decode(encode(array, threshold=threshold))
    assert_same(got, array)
    assert not got.flags.writeable


@pytest.mark.parametrize("threshold", [0, 10**9])
def test_shapes_scalars_and_empty_tensors_round_trip(threshold: int) -> None:
    values = [
        torch.tensor(3.5),
        torch.zeros(0),
        torch.zeros(2, 0, 3, dtype=torch.bfloat16),
        np.zeros((0, 4), dtype=np.float32),
        np.array(7, dtype=np.int32),
        torch.arange(6.0).reshape(2, 3).t(),  # non-contiguous
        np.arange(12.0).reshape(3, 4)[:, ::2],  # non-contiguous
    ]
    got = decode(encode(values, threshold=threshold))
    assert_same(got, values)


def test_opt_in_dtypes_need_an_extended_allow_list() -> None:
    tensor = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    frames = encode(tensor)
    with pytest.raises(DecodeError, match="dtype 'complex64' is not allowed"):
        decode(frames)
    limits = DecodeLimits(allowed_dtypes=DecodeLimits().allowed_dtypes | {"complex64"})
    assert_same(decode(frames, limits=limits), tensor)
    fp8 = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    limits = DecodeLimits(allowed_dtypes={"float8_e4m3fn"})
    assert_same(decode(encode(fp8, threshold=0), limits=limits), fp8)


def test_plain_value_subclasses_go_as_plain_values() -> None:
    class Color(enum.IntEnum):
        RED = 1

    class Key(enum.StrEnum):
        NAME = "name"

    value = OrderedDict([(Key.NAME, Color.RED), ("size", torch.Size([2, 3])), ("t", (1, "a"))])
    got = decode(encode(value))
    assert got == {"name": 1, "size": [2, 3], "t": [1, "a"]}
    assert type(got["name"]) is int and type(next(iter(got))) is str


def test_tensor_needing_grad_is_sent_as_values() -> None:
    tensor = torch.ones(100, requires_grad=True)
    got = decode(encode(tensor, threshold=0))
    assert not got.requires_grad and torch.equal(got, torch.ones(100))


# --- zero copy ------------------------------------------------------------------------------------


def test_aux_frame_is_a_view_of_the_tensor_memory() -> None:
    tensor = torch.randn(256, 256)
    frames = encode({"pixel_values": tensor})
    assert len(frames) == 2
    assert isinstance(frames[1], memoryview) and frames[1].nbytes == tensor.nbytes
    assert address(frames[1]) == tensor.data_ptr()
    tensor[0, 0] = 42.0  # shared memory: the frame sees the write
    assert np.frombuffer(frames[1], dtype=np.float32)[0] == 42.0


def test_bfloat16_and_numpy_frames_are_views_too() -> None:
    bf16 = torch.randn(64, 64).to(torch.bfloat16)
    array = np.arange(1000, dtype=np.float32)
    frames = encode([bf16, array])
    assert address(frames[1]) == bf16.data_ptr()
    assert address(frames[2]) == array.ctypes.data


def test_non_contiguous_tensor_is_made_contiguous_once() -> None:
    base = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    view = base.t()
    frames = encode(view)
    assert len(frames) == 2
    assert address(frames[1]) != base.data_ptr()
    assert bytes(frames[1]) == raw(view.contiguous())
    assert_same(decode(frames), view)


def test_small_strided_tensors_go_inline_as_c_order_bytes() -> None:
    base = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    values = [base.t(), base[:, ::2], torch.tensor([5], dtype=torch.int16).expand(4), array.T]
    strided = encode(values)
    contiguous = encode(
        [torch.tensor(v.tolist(), dtype=torch.int16) for v in values[:3]]
        + [np.ascontiguousarray(array.T)]
    )
    assert len(strided) == 1 and strided == contiguous  # byte for byte, all inline
    assert_same(decode(strided), values)


def test_aux_frames_keep_the_tensor_alive() -> None:
    frames = encode(torch.full((1000,), 7, dtype=torch.int32))
    gc.collect()
    assert np.frombuffer(frames[1], dtype=np.int32).tolist() == [7] * 1000


def test_decoded_tensor_is_a_view_over_the_received_frame() -> None:
    tensor = torch.randn(128, 128)
    body, aux = encode(tensor)
    received = bytearray(aux)  # stands in for a frame owned by the transport
    got = decode([body, received])
    assert got.data_ptr() == address(received)
    assert torch.equal(got, tensor)


def test_decoded_tensor_keeps_its_frame_alive() -> None:
    frames = [bytes(frame) for frame in encode(torch.arange(1000.0))]
    got = decode(frames)
    del frames
    gc.collect()
    assert torch.equal(got, torch.arange(1000.0))


def test_decoding_read_only_frames_gives_read_only_views_without_warnings() -> None:
    frames = [bytes(frame) for frame in encode([torch.arange(100.0), np.arange(100.0)])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor, array = decode(frames)
    assert tensor.sum().item() == sum(range(100))
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0] = 1.0


# --- threshold ------------------------------------------------------------------------------------


def test_threshold_default_env_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THRESHOLD_ENV, raising=False)
    assert zero_copy_threshold() == DEFAULT_THRESHOLD == 256
    tensor = torch.zeros(100, dtype=torch.uint8)
    assert len(encode(tensor)) == 1
    monkeypatch.setenv(THRESHOLD_ENV, "64")
    assert zero_copy_threshold() == 64
    assert len(encode(tensor)) == 2
    assert len(encode(tensor, threshold=1000)) == 1  # the argument wins
    monkeypatch.setenv(THRESHOLD_ENV, "")
    assert zero_copy_threshold() == DEFAULT_THRESHOLD


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "12kb"])
def test_bad_threshold_env_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(THRESHOLD_ENV, value)
    with pytest.raises(ConfigurationError, match=THRESHOLD_ENV):
        encode(torch.zeros(4))


@pytest.mark.parametrize("value", [-1, 1.5, "256", True])
def test_bad_threshold_argument_is_a_clear_error(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="threshold"):
        encode(torch.zeros(4), threshold=value)


# --- what cannot be encoded -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({1: "a"}, r"\$: dict key 1 is a int"),
        ({"a": [object()]}, r"\$\.a\[0\]: cannot encode an object of type object"),
        ({"a": {1, 2}}, "type set"),
        ({"x": 1j}, "type complex"),
        ({"x": np.float32(1.0)}, "numpy scalar"),
        (np.array([object()]), "object arrays would need pickle"),
        (np.array(["text"]), "cannot go on the wire"),
        (torch.zeros(2, device="meta"), "move it to the CPU"),
        (torch.zeros(3, 3).to_sparse(), "layout"),
        (2**64, "msgpack cannot pack"),
    ],
)
def test_unsupported_values_raise_encode_error_with_path(value: Any, match: str) -> None:
    with pytest.raises(EncodeError, match=match):
        encode(value)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_torch_dtype_without_plain_layout_is_refused() -> None:
    with pytest.raises(EncodeError, match=r"torch dtype torch\.complex32 cannot go"):
        encode({"x": torch.zeros(2, dtype=torch.complex32)})


def test_list_shaped_like_an_aux_tensor_is_refused() -> None:
    for value in (["float32", [2], 1], ("<f4", (2,), 3), {"k": ["uint8", [], 1]}):
        with pytest.raises(EncodeError, match="form of an encoded tensor"):
            encode(value)
    # Near misses are plain lists and round-trip as such.
    for value in (["hello", [2], 1], ["float32", [2], True], ["float32", [2], "x"]):
        assert decode(encode(value)) == value


def test_nesting_is_bounded_and_cycles_are_refused() -> None:
    deep: list[Any] = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(EncodeError, match="nested deeper"):
        encode(deep)
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(EncodeError, match="cycle"):
        encode(cycle)
    ok: list[Any] = [1]
    for _ in range(20):
        ok = [ok]
    assert decode(encode(ok)) == ok


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"max_objects": 0}, "max_objects must be a positive int"),
        ({"max_memory_ratio": 0}, "max_memory_ratio must be a positive int"),
        ({"max_memory_ratio": 1.5}, "max_memory_ratio must be a positive int"),
        ({"memory_allowance": -1}, "memory_allowance must be an int >= 0"),
        ({"memory_allowance": True}, "memory_allowance must be an int >= 0"),
    ],
)
def test_bad_memory_limits_are_configuration_errors(setting: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        DecodeLimits(**setting)


def test_a_message_over_its_memory_budget_is_refused_naming_the_limit() -> None:
    frames = encode([torch.zeros(1)] * 16)  # 16 tensor objects (~1 KiB each) in 200 bytes
    strict = DecodeLimits(max_memory_ratio=1, memory_allowance=0)
    with pytest.raises(DecodeError, match=r"bytes of objects.*DecodeLimits\.max_memory_ratio"):
        decode(frames, limits=strict)
    assert len(decode(frames)) == 16  # within the default budget's allowance
