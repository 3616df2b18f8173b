"""Dtype names on the wire, and which of them a decoder accepts.

A tensor travels as ``[dtype, shape, data]``. The dtype string says both the element type and which
library the value is rebuilt with, exactly as vLLM's serializer writes it:

* a torch tensor carries the name torch prints, without the ``torch.`` prefix (``"float32"``,
  ``"bfloat16"``, ``"bool"``);
* a numpy array carries numpy's ``dtype.str``, which starts with a byte-order character
  (``"<f4"``, ``"|u1"``, ``"|b1"``).

The two families cannot be confused: no torch name starts with ``<``, ``>``, ``|`` or ``=``.

The decoder only rebuilds dtypes from an allow-list (`DEFAULT_ALLOWED_DTYPES` unless configured).
Object, string, void and datetime dtypes can never be allowed: nothing on the wire is ever
unpickled or interpreted as Python objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from mmproc.errors import ConfigurationError

__all__ = [
    "DEFAULT_ALLOWED_DTYPES",
    "TORCH_DTYPE_NAMES",
    "TORCH_ENCODING",
    "DTypeSpec",
    "build_dtype_table",
    "is_dtype_name",
    "numpy_wire_name",
    "torch_wire_name",
]


@dataclass(frozen=True, slots=True)
class DTypeSpec:
    """How one wire dtype name is rebuilt: the library's dtype object and its item size."""

    name: str
    """The dtype string as it appears on the wire."""
    itemsize: int
    """Bytes per element; ``prod(shape) * itemsize`` must equal the data's byte length."""
    torch_dtype: torch.dtype | None
    """The torch dtype for a torch name, else None."""
    numpy_dtype: np.dtype | None
    """The numpy dtype for a numpy dtype string, else None."""
    boolean: bool = False
    """Whether elements are bools, whose bytes must each be 0 or 1."""


# The torch dtypes that can cross the wire. Quantized and sub-byte types are left out on purpose:
# their storage is not a plain array of `itemsize`-byte elements, so the byte-length check that
# protects the decoder would not mean what it says.
_TORCH_CANDIDATES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)

_TORCH_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _TORCH_CANDIDATES
    if isinstance(getattr(torch, name, None), torch.dtype)
}

TORCH_DTYPE_NAMES: frozenset[str] = frozenset(_TORCH_BY_NAME)
"""Every torch dtype name this codec can encode (a decoder accepts only its allow-list)."""

# numpy has no bfloat16 / float8: such tensors are reinterpreted, without a copy, as an integer
# type of the same width before `.numpy()` exposes their memory.
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_NATIVE_TORCH = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
}

TORCH_ENCODING: dict[torch.dtype, tuple[str, torch.dtype | None]] = {
    dtype: (name, None if dtype in _NUMPY_NATIVE_TORCH else _SAME_WIDTH_INT[dtype.itemsize])
    for name, dtype in _TORCH_BY_NAME.items()
}
"""torch dtype -> (wire name, same-width dtype to view as before ``.numpy()``, or None)."""

# Element kinds with a plain fixed-size binary layout: bool, signed, unsigned, float, complex.
_NUMPY_KINDS = frozenset("biufc")

_DEFAULT_TORCH = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)
_DEFAULT_NUMPY = (
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
)

DEFAULT_ALLOWED_DTYPES: frozenset[str] = (
    frozenset(_DEFAULT_TORCH)
    | frozenset(np.dtype(name).str for name in _DEFAULT_NUMPY)
    | {"<i8"}  # the request schema's token ids, little-endian on every machine
)
"""What a decoder rebuilds by default: the usual model-input dtypes, torch and numpy (in this
machine's byte order), plus ``"<i8"``, which engine requests carry their token ids in. Complex,
unsigned torch and float8 names are known but must be opted in."""


def torch_wire_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def numpy_wire_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype: its ``.str`` with byte order (``"<f4"``)."""
    return dtype.str


def is_dtype_name(value: str) -> bool:
    """Whether ``value`` reads as a dtype name of either family.

    The decoder treats ``[name, [dims...], frame_index]`` as a tensor exactly when this holds for
    ``name``; the encoder refuses plain lists of that form so that they cannot be mistaken for one.
    """
    return value in TORCH_DTYPE_NAMES or (len(value) >= 2 and value[0] in "<>|=")


def _spec_for(name: str) -> DTypeSpec:
    torch_dtype = _TORCH_BY_NAME.get(name)
    if torch_dtype is not None:
        return DTypeSpec(name, torch_dtype.itemsize, torch_dtype, None, torch_dtype is torch.bool)
    if len(name) < 2 or name[0] not in "<>|=":
        raise ConfigurationError(
            f"dtype {name!r} is neither a torch dtype name ({', '.join(sorted(TORCH_DTYPE_NAMES))})"
            " nor a numpy dtype string with byte order such as '<f4'"
        )
    try:
        np_dtype = np.dtype(name)
    except TypeError as exc:
        raise ConfigurationError(f"dtype {name!r} is not a numpy dtype string: {exc}") from None
    if np_dtype.kind not in _NUMPY_KINDS or np_dtype.fields is not None or np_dtype.subdtype:
        raise ConfigurationError(
            f"dtype {name!r} (kind {np_dtype.kind!r}) cannot be allowed: only bool, integer, "
            "float and complex element types have a plain binary layout"
        )
    if np_dtype.str != name:
        # e.g. '=f4' or '<u1': the encoder never writes these spellings, so allowing one would be
        # a configuration mistake that silently matches nothing.
        raise ConfigurationError(
            f"dtype {name!r} is not how numpy writes it on the wire; use {np_dtype.str!r}"
        )
    return DTypeSpec(name, np_dtype.itemsize, None, np_dtype, np_dtype.kind == "b")


def build_dtype_table(allowed: Iterable[str]) -> Mapping[str, DTypeSpec]:
    """Resolve an allow-list of wire dtype names; a name that is unknown or unsafe is a
    `ConfigurationError`."""
    return {name: _spec_for(name) for name in allowed}
