"""Media items in vLLM's render format: one base64 string of msgpack per item.

vLLM's render tier answers each item as ``MultiModalKwargsItem`` msgpack (its ``mm_serde``)::

    {key: {"data": [dtype, shape, ExtType(3, raw C-order bytes)], "field": [kind, {options}]}}

with ``dtype`` torch's name without ``torch.`` (``"uint8"``), and the field kinds ``batched``
(``{"keep_on_cpu"}``), ``flat`` (``{"keep_on_cpu", "slices", "dim"}``, the item's own slice) and
``shared`` (``{"keep_on_cpu", "batch_size"}``). :func:`encode_item` writes that from an mmproc
feature and the model's fields: a ``FlatField`` is ``flat`` along its ``dim``, a
``SharedField`` ``shared``, anything else (``BatchedField``, ``PaddedField``: each item holds its
own tensor) ``batched``. Small non-pixel outputs (grids, timestamps) are ``keep_on_cpu``, as
vLLM's model definitions mark them; ``mm_metadata`` holds those alone.

The msgpack is written here around the tensors' own memory and base64-encoded with pybase64
(SIMD) in pieces: the small msgpack parts together, each tensor straight from its memory (cut at
a multiple of 3 bytes, so the pieces' base64 joined is the whole's). The tensors' bytes are
never joined into one copy, and the answer sends the pieces as they are; fresh megabyte
buffers cost page faults on every request.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import pybase64
import torch

from mmproc.fields import FieldSpec, FlatField, SharedField

__all__ = ["encode_item", "encode_metadata", "keeps_on_cpu"]

_EXT_RAW_VIEW = 3  # vLLM's CUSTOM_TYPE_RAW_VIEW
_SMALL = 64  # elements: an output this small and not pixels is metadata (grids, timestamps)


def keeps_on_cpu(key: str, value: torch.Tensor, pixel_keys: frozenset[str]) -> bool:
    """Whether vLLM's engine keeps the output on the CPU: small outputs that are not pixels."""
    return key not in pixel_keys and (not value.dtype.is_floating_point or value.numel() <= _SMALL)


def _ext_header(size: int) -> bytes:
    """msgpack's header of an ext of type 3 and ``size`` bytes."""
    if size in (1, 2, 4, 8, 16):
        return bytes([{1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}[size], _EXT_RAW_VIEW])
    if size < 1 << 8:
        return bytes([0xC7, size, _EXT_RAW_VIEW])
    if size < 1 << 16:
        return b"\xc8" + struct.pack(">H", size) + bytes([_EXT_RAW_VIEW])
    return b"\xc9" + struct.pack(">I", size) + bytes([_EXT_RAW_VIEW])


def _field(spec: FieldSpec | None, value: torch.Tensor, keep_on_cpu: bool) -> list[Any]:
    if isinstance(spec, FlatField):
        length = int(value.shape[spec.dim]) if value.ndim else 0
        dim = spec.dim if spec.dim >= 0 else spec.dim + value.ndim
        return ["flat", {"keep_on_cpu": keep_on_cpu, "slices": [[[0, length, None]]], "dim": dim}]
    if isinstance(spec, SharedField):
        return ["shared", {"keep_on_cpu": keep_on_cpu, "batch_size": 1}]
    return ["batched", {"keep_on_cpu": keep_on_cpu}]


def _tensor_parts(value: torch.Tensor) -> list[Any]:
    """The msgpack of ``[dtype, shape, ExtType(3, bytes)]``: small parts packed, the tensor's
    bytes a view of its memory."""
    tensor = value.detach().contiguous()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, as 2-byte ints
        raw = tensor.view(torch.int16).numpy()
    else:
        raw = tensor.numpy()
    data = np.ascontiguousarray(raw).data.cast("B")
    dtype = str(tensor.dtype).removeprefix("torch.")
    head = b"\x93" + msgpack.packb(dtype) + msgpack.packb(list(tensor.shape))
    return [head, _ext_header(len(data)), data]


_BIG = 1 << 16  # bytes: a part this big is base64-encoded from its own memory


def _encode(entries: list[tuple[str, torch.Tensor, list[Any]]]) -> list[bytes]:
    parts: list[Any] = [_map_header(len(entries))]
    for key, value, field in entries:
        parts.append(msgpack.packb(key))
        parts.append(b"\x82" + msgpack.packb("data"))
        parts.extend(_tensor_parts(value))
        parts.append(msgpack.packb("field") + msgpack.packb(field))
    return _base64_pieces(parts)


def _base64_pieces(parts: list[Any]) -> list[bytes]:
    """The base64 of ``parts`` joined, as pieces: small parts gathered, big ones encoded from
    their own memory. Every piece but the last encodes a multiple of 3 bytes, so no piece has
    padding inside the whole."""
    pieces: list[bytes] = []
    pending = bytearray()
    for part in parts:
        view = memoryview(part).cast("B")
        if len(view) < _BIG:
            pending += view
            continue
        lead = -len(pending) % 3
        pending += view[:lead]
        if pending:
            pieces.append(pybase64.b64encode(pending))
        body = (len(view) - lead) // 3 * 3
        pieces.append(pybase64.b64encode(view[lead : lead + body]))
        pending = bytearray(view[lead + body :])
    if pending or not pieces:
        pieces.append(pybase64.b64encode(pending))
    return pieces


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x80 | count])
    return b"\xde" + struct.pack(">H", count)


def _entries(
    data: Mapping[str, Any], fields: Mapping[str, FieldSpec], pixel_keys: frozenset[str]
) -> list[tuple[str, torch.Tensor, list[Any], bool]]:
    out = []
    for key in sorted(data):
        value = torch.as_tensor(data[key])
        keep = keeps_on_cpu(key, value, pixel_keys)
        out.append((key, value, _field(fields.get(key), value, keep), keep))
    return out


def encode_item(
    data: Mapping[str, Any], fields: Mapping[str, FieldSpec], pixel_keys: frozenset[str]
) -> list[bytes]:
    """One item's outputs as vLLM's base64 ``MultiModalKwargsItem`` msgpack (``kwargs_data``),
    in pieces of ASCII whose concatenation is the string."""
    return _encode([(k, v, f) for k, v, f, _ in _entries(data, fields, pixel_keys)])


def encode_metadata(
    data: Mapping[str, Any], fields: Mapping[str, FieldSpec], pixel_keys: frozenset[str]
) -> list[bytes] | None:
    """The item's ``keep_on_cpu`` outputs alone, as vLLM's ``mm_metadata``; None if it has none."""
    kept = [(k, v, f) for k, v, f, keep in _entries(data, fields, pixel_keys) if keep]
    return _encode(kept) if kept else None
