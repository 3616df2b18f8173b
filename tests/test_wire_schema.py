"""The engine request schema: round trip, wire layout, versioning and validation."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from mmproc.errors import DecodeError, EncodeError
from mmproc.wire import (
    SCHEMA_VERSION,
    EngineRequest,
    WireFeature,
    decode,
    decode_request,
    encode,
    encode_request,
)

NORM = {"mean": [0.48, 0.46, 0.41], "std": [0.27, 0.26, 0.28], "rescale": 1 / 255, "layout": "chw"}


def image_feature(index: int = 0, offset: int = 2, length: int = 4) -> WireFeature:
    return WireFeature(
        modality="image",
        item_index=index,
        hash=f"hash-{index}",
        offset=offset,
        length=length,
        is_embed=torch.tensor([True, False] * (length // 2)),
        data={
            "pixel_values": torch.randint(0, 255, (16, 588), dtype=torch.uint8),
            "image_grid_thw": torch.tensor([1, 4, 4]),
        },
        norm=NORM,
    )


def make_request(**overrides: Any) -> EngineRequest:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "prompt_token_ids": list(range(100, 120)),
        "features": [image_feature(0, 2, 4), image_feature(1, 10, 6)],
        "params": {"temperature": 0.7, "max_tokens": 32, "stop": ["\n"]},
    }
    fields.update(overrides)
    if "prompt_outputs" not in fields:
        length = len(fields["prompt_token_ids"])
        fields["prompt_outputs"] = {"mm_token_type_ids": torch.arange(length) % 3}
    return EngineRequest(**fields)


def assert_same_request(got: EngineRequest, expected: EngineRequest) -> None:
    assert got.request_id == expected.request_id
    assert got.prompt_token_ids == expected.prompt_token_ids
    assert got.params == expected.params
    assert list(got.prompt_outputs) == list(expected.prompt_outputs)
    for name, tensor in expected.prompt_outputs.items():
        assert torch.equal(got.prompt_outputs[name], tensor)
    assert len(got.features) == len(expected.features)
    for g, e in zip(got.features, expected.features):
        assert (g.modality, g.item_index, g.hash, g.offset, g.length, g.norm) == (
            e.modality,
            e.item_index,
            e.hash,
            e.offset,
            e.length,
            e.norm,
        )
        if e.is_embed is None:
            assert g.is_embed is None
        else:
            assert g.is_embed is not None and torch.equal(g.is_embed, e.is_embed)
        assert list(g.data) == list(e.data)
        for key, tensor in e.data.items():
            assert g.data[key].dtype == tensor.dtype and torch.equal(g.data[key], tensor)


def test_request_round_trips_with_tensors_in_aux_frames() -> None:
    request = make_request()
    frames = encode_request(request)
    # the two pixel tensors leave as frames; grids and is_embed are small enough to stay inline
    assert len(frames) == 3
    assert frames[1].nbytes == 16 * 588
    got = decode_request(frames)
    assert_same_request(got, request)
    assert got.features[0].needs_device_norm


def test_request_wire_layout() -> None:
    request = make_request(features=[image_feature(0, 2, 4)], params={})
    frames = encode_request(request, threshold=1024)
    body = msgpack.unpackb(frames[0])
    assert list(body) == [
        "schema_version",
        "request_id",
        "prompt_token_ids",
        "features",
        "params",
        "prompt_outputs",
    ]
    assert body["schema_version"] == SCHEMA_VERSION == 4
    types = (np.arange(20) % 3).astype("<i8").tobytes()
    assert body["prompt_outputs"] == {
        "mm_token_type_ids": ["int64", [20], msgpack.ExtType(3, types)]
    }
    # token ids: one little-endian int64 array (inline here: 20 ids are 160 bytes < 1024)
    ids = np.arange(100, 120, dtype="<i8").tobytes()
    assert body["prompt_token_ids"] == ["<i8", [20], msgpack.ExtType(3, ids)]
    (feature,) = body["features"]
    assert list(feature) == [
        "modality",
        "item_index",
        "hash",
        "offset",
        "length",
        "is_embed",
        "data",
        "norm",
        "ref",
    ]
    assert feature["ref"] is None  # in full
    assert feature["data"]["pixel_values"] == ["uint8", [16, 588], 1]
    assert feature["data"]["image_grid_thw"][:2] == ["int64", [3]]
    assert feature["is_embed"] == ["bool", [4], msgpack.ExtType(3, b"\x01\x00\x01\x00")]
    assert feature["norm"] == NORM


def test_feature_without_norm_or_is_embed() -> None:
    feature = WireFeature("audio", 0, "h", 0, 3, None, {"input_features": torch.zeros(80, 30)})
    request = EngineRequest("a", [1, 2, 3], [feature])
    got = decode_request(encode_request(request))
    assert got.features[0].is_embed is None and got.features[0].norm is None
    assert not got.features[0].needs_device_norm
    assert_same_request(got, request)


def test_request_without_features_and_with_tensor_params() -> None:
    request = EngineRequest("t", [5], params={"bias": torch.ones(300)})
    got = decode_request(encode_request(request))
    assert got.features == [] and torch.equal(got.params["bias"], torch.ones(300))


def test_other_schema_version_is_rejected_clearly() -> None:
    wire = make_request().to_wire()
    wire["schema_version"] = 3  # the release before features by reference
    with pytest.raises(DecodeError, match=r"schema version 3.*reads version 4.*same mmproc"):
        decode_request(encode(wire))
    del wire["schema_version"]
    with pytest.raises(DecodeError, match="no 'schema_version'"):
        decode_request(encode(wire))
    wire["schema_version"] = True
    with pytest.raises(DecodeError, match="schema version True"):
        decode_request(encode(wire))


def test_missing_and_unknown_keys_are_rejected() -> None:
    wire = make_request().to_wire()
    wire["surprise"] = 1
    with pytest.raises(DecodeError, match=r"unknown \['surprise'\]"):
        decode_request(encode(wire))
    wire = make_request().to_wire()
    del wire["features"][1]["hash"]
    with pytest.raises(DecodeError, match=r"feature 1: feature map has the wrong keys: missing"):
        decode_request(encode(wire))


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("request_id",), 5, "request_id must be a str"),
        (("request_id",), "", "request_id must not be empty"),
        (("prompt_token_ids",), [1, 2], r"prompt_token_ids: expected a tensor"),
        (("prompt_token_ids",), np.array([1, -1]), r"\[0, 2\*\*63\)"),
        (("prompt_token_ids",), np.array([1.0, 2.0]), r"'<i8' \(int64\) array, got <f8 array"),
        (("prompt_token_ids",), np.array([1, 2], dtype="<i4"), r"got <i4 array of shape \(2,\)"),
        (("prompt_token_ids",), np.zeros((2, 10), dtype="<i8"), r"of shape \(2, 10\)"),
        (("prompt_token_ids",), torch.arange(20), r"got torch.int64 tensor of shape \(20,\)"),
        (("prompt_token_ids",), "abc", r"prompt_token_ids: expected a tensor"),
        (("prompt_token_ids",), np.arange(3), r"spans prompt positions 2\.\.6 but the prompt has"),
        (("features",), {}, "features must be a list"),
        (("features", 0), [1], "feature must be a map"),
        (("features", 0, "offset"), 18, r"spans prompt positions 18\.\.22"),
        (("features", 0, "item_index"), -1, "item_index must be >= 0"),
        (("features", 1, "item_index"), 0, "image item 0 twice"),
        (("features", 0, "modality"), 3, "modality must be a str"),
        (("features", 0, "is_embed"), np.ones(4, dtype=bool), "bool tensor or None"),
        (("features", 0, "is_embed"), torch.ones(3, dtype=torch.bool), r"shape \(4,\)"),
        (("features", 0, "is_embed"), torch.ones(4), "bool tensor of shape"),
        (("features", 0, "data"), {"x": np.zeros(3)}, r"data\['x'\] must be a torch tensor"),
        (("features", 0, "data"), {"x": 1}, r"\$\.features\[0\]\.data\.x: expected a tensor"),
        (("features", 0, "is_embed"), "yes", r"is_embed: expected a tensor"),
        (("features", 0, "norm"), {"keys": ["a", 1]}, "list of numbers"),
        (("features", 0, "norm"), {"mean": {"nested": b"raw"}}, r"norm\['mean'\]"),
        (("features", 0, "norm"), [1.0], "norm must be a dict"),
        (("params",), [], "params must be a dict"),
        (("prompt_outputs",), [], "prompt_outputs must be a map"),
        (("prompt_outputs",), {"x": [1, 2]}, r"prompt_outputs\.x: expected a tensor"),
        (("prompt_outputs",), {"x": torch.zeros(19)}, r"has shape \(19,\); it must have one"),
        (("prompt_outputs",), {"x": torch.zeros(20, 2)}, r"has shape \(20, 2\)"),
    ],
)
def test_decoded_fields_are_validated(path: tuple[Any, ...], value: Any, match: str) -> None:
    wire = make_request().to_wire()
    target: Any = wire
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(DecodeError, match=match):
        decode_request(encode(wire))


def test_construction_validates_with_type_and_value_errors() -> None:
    with pytest.raises(TypeError, match="prompt_token_ids must be a list"):
        make_request(prompt_token_ids=(1, 2))
    with pytest.raises(ValueError, match="spans prompt positions"):
        make_request(prompt_token_ids=[1, 2, 3])
    with pytest.raises(TypeError, match="must be a WireFeature"):
        make_request(features=[{"modality": "image"}])
    with pytest.raises(TypeError, match="norm"):
        WireFeature("image", 0, "h", 0, 1, None, {}, norm={"mean": (0.5,)})
    with pytest.raises(TypeError, match=r"prompt_outputs\['x'\] must be a torch.Tensor"):
        make_request(prompt_outputs={"x": np.zeros(20)})
    with pytest.raises(ValueError, match=r"prompt_outputs\['x'\] has shape \(3,\)"):
        make_request(prompt_outputs={"x": torch.zeros(3)})
    with pytest.raises(TypeError, match="item_index must be an int"):
        WireFeature("image", True, "h", 0, 1, None, {})


@pytest.mark.parametrize("ids", [[0], [2**63 - 1], [7, 2**63 - 1, 0], list(range(5000))])
def test_token_ids_at_the_ends_of_the_range_are_accepted(ids: list[int]) -> None:
    request = EngineRequest("r", ids)
    assert decode_request(encode_request(request)).prompt_token_ids == ids


@pytest.mark.parametrize(
    "ids", [[-1], [1, -(2**63)], [2**63], [0, 2**64 - 1], [2**64], [3, 2**70, 4], [1] * 999 + [-1]]
)
def test_token_ids_out_of_range_are_refused_on_construction_and_decode(ids: list[int]) -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        EngineRequest("r", ids)
    if not all(-(2**63) <= i < 2**63 for i in ids):
        return  # no int64 array can carry them: they cannot reach a receiver at all
    wire = make_request().to_wire()
    wire["prompt_token_ids"] = np.array(ids, dtype="<i8")
    wire["features"] = []
    with pytest.raises(DecodeError, match=r"\[0, 2\*\*63\)"):
        decode_request(encode(wire))


def test_unusual_but_valid_field_types_take_the_full_checks() -> None:
    import enum

    class Index(enum.IntEnum):
        FIRST = 0

    class Modality(enum.StrEnum):
        IMAGE = "image"

    class Norm(dict):  # type: ignore[type-arg]
        pass

    pixels = torch.nn.Parameter(torch.zeros(2, 3))  # a tensor subclass
    feature = WireFeature(
        Modality.IMAGE, Index.FIRST, "h", 0, 2, None, {"pixel_values": pixels}, Norm(mean=[0.5])
    )
    request = EngineRequest("r", [1, 2], [feature])
    got = decode_request(encode_request(request))
    assert got.features[0].modality == "image" and got.features[0].item_index == 0
    assert torch.equal(got.features[0].data["pixel_values"], torch.zeros(2, 3))
    assert got.features[0].norm == {"mean": [0.5]}


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("modality", "", ValueError),
        ("modality", b"image", TypeError),
        ("item_index", False, TypeError),
        ("item_index", -3, ValueError),
        ("hash", None, TypeError),
        ("offset", 1.0, TypeError),
        ("length", -1, ValueError),
        ("is_embed", torch.ones(4, dtype=torch.uint8), ValueError),
        ("is_embed", torch.ones(3, dtype=torch.bool), ValueError),
        ("is_embed", [True] * 4, TypeError),
        ("data", [], TypeError),
        ("data", {1: torch.zeros(1)}, TypeError),
        ("data", {"x": np.zeros(1)}, TypeError),
        ("norm", {"mean": [0.5, "a"]}, TypeError),
        ("norm", {"mean": [[[[[1.0]]]]]}, TypeError),
        ("norm", {1: 0.5}, TypeError),
        ("norm", (("mean", 0.5),), TypeError),
    ],
)
def test_feature_construction_refuses_each_bad_field(field: str, value: Any, error: type) -> None:
    fields: dict[str, Any] = {
        "modality": "image",
        "item_index": 0,
        "hash": "h",
        "offset": 0,
        "length": 4,
        "is_embed": None,
        "data": {"x": torch.zeros(1)},
        "norm": {"mean": [0.5, 0.5], "layout": {"names": ["a", "b"], "patch": 14}},
    }
    WireFeature(**fields)  # the baseline is valid
    fields[field] = value
    with pytest.raises(error, match=field):
        WireFeature(**fields)


def test_unencodable_params_fail_at_send_time_with_the_path() -> None:
    request = make_request(params={"callback": print})
    with pytest.raises(EncodeError, match=r"\$\.params\.callback"):
        encode_request(request)


def test_decoded_request_tensors_are_views_over_frames() -> None:
    request = make_request()
    frames = [bytearray(frame) for frame in encode_request(request)]
    got = decode_request(frames)
    pixels = got.features[0].data["pixel_values"]
    assert pixels.data_ptr() == np.frombuffer(frames[1], dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("ids", [[], list(range(100, 120)), list(range(5000))])
def test_encode_request_writes_the_same_bytes_as_encoding_to_wire(ids: list[int]) -> None:
    overrides: dict[str, Any] = {"prompt_token_ids": ids}
    if len(ids) < 20:
        overrides["features"] = []  # the features' placeholders need 16 prompt positions
    request = make_request(**overrides)
    direct = encode_request(request, threshold=512)
    generic = encode(request.to_wire(), threshold=512)
    assert direct[0] == generic[0]
    assert [bytes(frame) for frame in direct[1:]] == [bytes(frame) for frame in generic[1:]]
    assert decode_request(direct).prompt_token_ids == ids


def test_from_wire_builds_from_a_generically_decoded_map() -> None:
    request = make_request()
    assert_same_request(EngineRequest.from_wire(decode(encode_request(request))), request)
    with pytest.raises(DecodeError, match="must be a map"):
        EngineRequest.from_wire([1, 2])
    wire = request.to_wire()
    wire["prompt_token_ids"] = request.prompt_token_ids  # a plain list: the v1 layout
    with pytest.raises(DecodeError, match=r"must be a 1-D '<i8' \(int64\) array, got list"):
        EngineRequest.from_wire(wire)


def test_generic_decode_sees_the_plain_map() -> None:
    request = make_request()
    wire = decode(encode_request(request))
    assert wire["schema_version"] == SCHEMA_VERSION
    assert isinstance(wire["features"][0]["data"]["pixel_values"], torch.Tensor)


def test_wire_public_api_is_sorted_documented_and_resolves() -> None:
    import mmproc.wire as wire

    assert wire.__all__ == sorted(wire.__all__)
    for name in wire.__all__:
        value = getattr(wire, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    assert wire.DecodeError is DecodeError


def test_importing_mmproc_does_not_import_the_wire_stack() -> None:
    import subprocess
    import sys

    code = "import sys, mmproc; print(sorted({'torch', 'zmq', 'msgpack'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_norm_spec_travels_and_comes_back() -> None:
    from mmproc.norm_spec import ChannelLayout, NormSpec

    spec = NormSpec(
        mean=(0.5, 0.4, 0.3),
        std=(0.2, 0.25, 0.3),
        rescale=1 / 255,
        layout=ChannelLayout.flat_patches(14, 2),
        pixel_keys=("pixel_values", "pixel_values_videos"),
    )
    request = make_request()
    feature = request.features[0]
    with_norm = EngineRequest(
        request.request_id,
        request.prompt_token_ids,
        [
            WireFeature(
                feature.modality,
                feature.item_index,
                feature.hash,
                feature.offset,
                feature.length,
                feature.is_embed,
                feature.data,
                spec.to_wire(),
            )
        ],
        request.params,
    )
    decoded = decode_request(encode_request(with_norm))
    assert NormSpec.from_wire(decoded.features[0].norm) == spec


def test_token_ids_changed_after_construction_fail_to_encode_with_the_path() -> None:
    request = EngineRequest("r", [1, 2])
    request.prompt_token_ids.append(1.5)  # the docs say read-only; this is what happens if not
    with pytest.raises(EncodeError, match=r"\$\.prompt_token_ids: token ids changed"):
        encode_request(request)


def test_a_prompt_over_the_token_limit_is_refused_before_its_ints_are_made() -> None:
    from mmproc.wire import DecodeLimits

    frames = encode_request(EngineRequest("r", list(range(10_000))))
    limits = DecodeLimits(max_prompt_tokens=9_999)
    with pytest.raises(DecodeError, match=r"10000 prompt token ids, more than the limit of 9999"):
        decode_request(frames, limits=limits)
    assert (
        len(decode_request(frames, limits=DecodeLimits(max_prompt_tokens=10_000)).prompt_token_ids)
        == 10_000
    )


def test_from_wire_holds_decoded_maps_to_the_token_limit_and_the_version_type() -> None:
    from mmproc.wire import DecodeLimits

    wire = decode(encode_request(EngineRequest("r", list(range(5_000)))))
    with pytest.raises(DecodeError, match="5000 prompt token ids, more than the limit of 4999"):
        EngineRequest.from_wire(wire, limits=DecodeLimits(max_prompt_tokens=4_999))
    assert len(EngineRequest.from_wire(wire).prompt_token_ids) == 5_000  # default limits
    wire["schema_version"] = np.array([2, 2])  # compares element-wise: a type check first
    with pytest.raises(DecodeError, match="schema version"):
        EngineRequest.from_wire(wire)
