"""The msgpack codec: plain values plus tensors, with big tensors in their own frames.

A message is a list of buffers. Frame 0 is the msgpack body; every further frame ("aux frame") is
the raw C-order bytes of one tensor. Inside the body a torch tensor or numpy array is the msgpack
array ``[dtype, shape, data]`` (the layout of vLLM's serializer, kept byte-compatible):

* ``dtype`` -- torch's name without ``torch.`` (``"bfloat16"``) or numpy's ``dtype.str``
  (``"<f4"``); the family decides whether a torch tensor or a numpy array comes back;
* ``shape`` -- an array of non-negative ints;
* ``data`` -- msgpack ext type 3 holding the raw bytes when the tensor is smaller than the
  zero-copy threshold, else the int index (>= 1) of the aux frame holding them.

Zero copy both ways: an aux frame returned by `encode` is a view of the tensor's own memory (a
non-contiguous tensor is made contiguous once, which is the only copy), and `decode` builds every
tensor as a view over the frame it came in (``torch.frombuffer`` / ``numpy.frombuffer``). Decoded
tensors and arrays are therefore **read-only views**: they keep the received frames alive, numpy
arrays are flagged read-only, and torch tensors (which torch cannot flag) must not be written to
-- ``.clone()`` one first if it needs to change.

`decode` trusts nothing it is given. Before anything is built it checks frame count, byte totals
and body size against `DecodeLimits`; the msgpack parse (`mmproc.wire.parse`) is bounded in
values, containers, depth and memory, every object charged to a budget of
``max_memory_ratio x the message's size`` (at least 256 KiB) before it is built, and only ext
type 3 is accepted (nothing is ever unpickled); every tensor's dtype must be on the allow-list,
its shape made of non-negative ints, ``prod(shape) * itemsize`` equal to the bytes it points at,
frame indices in range and every aux frame referenced exactly once; each tensor object is
charged to the same budget. Whatever is wrong surfaces as `mmproc.errors.DecodeError` naming
the fault and where it was (``$.features[0].data.pixel_values``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias, TypeVar

import msgpack
import numpy as np
import torch

from mmproc.errors import ConfigurationError, DecodeError, EncodeError
from mmproc.wire.dtypes import (
    DEFAULT_ALLOWED_DTYPES,
    TORCH_ENCODING,
    DTypeSpec,
    build_dtype_table,
    is_dtype_name,
)
from mmproc.wire.parse import (
    MAP_HEADERS,
    MEMORY_ALLOWANCE,
    WORST_BYTES_PER_BYTE,
    Fault,
    MemoryBudget,
    describe_first_byte,
    parse_body,
    parse_whole,
    short_repr,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_THRESHOLD",
    "EXT_RAW_VIEW",
    "THRESHOLD_ENV",
    "DecodeLimits",
    "Frame",
    "decode",
    "encode",
    "zero_copy_threshold",
]

THRESHOLD_ENV: Final = "MMPROC_ZERO_COPY_THRESHOLD"
"""Environment variable holding the zero-copy threshold in bytes."""

DEFAULT_THRESHOLD: Final = 256
"""Tensors of at least this many bytes leave as aux frames (same default as vLLM)."""

EXT_RAW_VIEW: Final = 3
"""msgpack ext type code of inline raw tensor bytes (vLLM's ``CUSTOM_TYPE_RAW_VIEW``)."""

DEFAULT_MAX_DEPTH: Final = 32
"""Deepest nesting of arrays and maps the encoder writes and the default decoder accepts. A tensor
counts two levels (its ``[dtype, shape, data]`` array and the shape array)."""

# The decoder walks the tree recursively; this cap keeps any configured depth far below Python's
# recursion limit (and below msgpack's own parse stack of 1024).
_DEPTH_CEILING: Final = 256

# Largest product of a shape's non-zero dimensions times the item size that torch and numpy can
# represent (both index with int64). Checked before building even a zero-element tensor, whose
# strides are still computed from the other dimensions.
_MAX_EXTENT: Final = 2**62

Frame: TypeAlias = bytes | memoryview
"""One buffer of an encoded message: frame 0 is ``bytes``, aux frames are ``memoryview``s."""

_T = TypeVar("_T")

_PLAIN: Final[frozenset[type]] = frozenset({type(None), bool, int, float, str, bytes})


# --- threshold ----------------------------------------------------------------------------------


def zero_copy_threshold(threshold: int | None = None) -> int:
    """The zero-copy threshold in bytes: ``threshold`` if given, else the environment variable
    ``MMPROC_ZERO_COPY_THRESHOLD`` (unset or empty means the default, 256).

    A tensor whose byte size is below the threshold is written inline into the msgpack body;
    any other tensor (including every tensor when the threshold is 0) becomes an aux frame.
    Raises `ConfigurationError` for a value that is not a non-negative integer.
    """
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, int):
            raise ConfigurationError(
                f"zero-copy threshold must be an int number of bytes, got {threshold!r}"
            )
        if threshold < 0:
            raise ConfigurationError(f"zero-copy threshold must be >= 0 bytes, got {threshold}")
        return int(threshold)
    raw = os.environ.get(THRESHOLD_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_THRESHOLD
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigurationError(
            f"{THRESHOLD_ENV}={raw!r} is not an integer number of bytes "
            f"(default {DEFAULT_THRESHOLD})"
        ) from None
    if value < 0:
        raise ConfigurationError(f"{THRESHOLD_ENV}={raw!r} must be >= 0 bytes")
    return value


def _ext_raw_view(data: bytes) -> msgpack.ExtType:
    """``msgpack.ExtType(EXT_RAW_VIEW, data)``, built as the namedtuple it is without the
    argument checks of its constructor (the code is a constant, ``data`` always bytes): three
    times cheaper, and one is built per small tensor."""
    return _tuple_new(msgpack.ExtType, (EXT_RAW_VIEW, data))


_tuple_new: Final = tuple.__new__


# --- encoding -----------------------------------------------------------------------------------


class TreeEncoder:
    """One encode call: walks the object, swaps tensors for ``[dtype, shape, data]``."""

    __slots__ = ("frames", "threshold")

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        # Slot 0 is replaced by the msgpack body once the walk has collected the aux frames.
        self.frames: list[Frame] = [b""]

    def walk(self, obj: Any, depth: int) -> Any:
        kind = type(obj)
        if kind in _PLAIN:
            return obj
        if kind is list or kind is tuple:
            return self._sequence(obj, depth)
        if kind is dict:
            return self._mapping(obj, depth)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, depth)
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj, depth)
        return self._other(obj, depth)

    def value(self, obj: Any, path: tuple[str | int, ...]) -> Any:
        """Encode one value found at ``path`` of a structure the caller lays out itself (the
        request schema does, to skip walking fields it has validated already)."""
        try:
            if type(obj) is torch.Tensor:  # the schema's tensors: skip the dispatch
                return self._tensor(obj, len(path))
            return self.walk(obj, len(path))
        except Fault as fault:
            fault.path.extend(reversed(path))
            raise

    def _sequence(self, obj: Sequence[Any], depth: int) -> Any:
        depth += 1
        if depth > DEFAULT_MAX_DEPTH:
            raise Fault(f"nested deeper than {DEFAULT_MAX_DEPTH} levels (or a cycle)")
        # Fast path, C speed: a list of scalars (token ids) goes to msgpack untouched.
        if set(map(type, obj)) <= _PLAIN:
            return obj
        out = []
        for index, item in enumerate(obj):
            if type(item) in _PLAIN:  # inline: most items need no call
                out.append(item)
                continue
            try:
                out.append(self.walk(item, depth))
            except Fault as fault:
                fault.path.append(index)
                raise
        if (
            len(out) == 3
            and type(out[0]) is str
            and type(out[1]) in (list, tuple)
            and type(out[2]) is int
            and is_dtype_name(out[0])
        ):
            # The decoder reads [dtype, [dims], int] as a tensor in an aux frame; a plain list of
            # that form would come back as something else (or be rejected).
            raise Fault(
                f"list {short_repr(out)} has the form of an encoded tensor [dtype, shape, frame] "
                "and would not decode as a list"
            )
        return out

    def _mapping(self, obj: Mapping[Any, Any], depth: int) -> dict[str, Any]:
        depth += 1
        if depth > DEFAULT_MAX_DEPTH:
            raise Fault(f"nested deeper than {DEFAULT_MAX_DEPTH} levels (or a cycle)")
        out: dict[str, Any] = {}
        for key, value in obj.items():
            if type(key) is not str:
                if not isinstance(key, str):
                    raise Fault(
                        f"dict key {short_repr(key)} is a {type(key).__name__}; only str keys "
                        "can go on the wire"
                    )
                key = str.__str__(key)  # a str subclass (StrEnum) goes as its plain value
            if type(value) in _PLAIN:  # inline: most values need no call
                out[key] = value
                continue
            try:
                out[key] = self.walk(value, depth)
            except Fault as fault:
                fault.path.append(key)
                raise
        return out

    def _tensor(self, tensor: torch.Tensor, depth: int) -> list[Any]:
        if depth + 2 > DEFAULT_MAX_DEPTH:
            raise Fault(f"tensor nested deeper than {DEFAULT_MAX_DEPTH} levels")
        encoding = TORCH_ENCODING.get(tensor.dtype)
        if encoding is None:
            raise Fault(f"torch dtype {tensor.dtype} cannot go on the wire")
        name, view_as = encoding
        # Fast path for the common case (CPU, dense, no autograd): `.numpy()` refuses everything
        # else, and only then is the tensor examined in detail.
        try:
            array = (tensor if view_as is None else tensor.view(view_as)).numpy()
        except (RuntimeError, TypeError, ValueError):
            array = self._host_array(tensor, view_as)
        nbytes = array.nbytes
        if nbytes < self.threshold:
            # Small: one copy into the body is cheaper than a frame of its own. tobytes() writes
            # C order whatever the strides, so a non-contiguous view needs no detour here.
            return [name, array.shape, _ext_raw_view(array.tobytes())]
        if not array.flags.c_contiguous:  # strided: the one copy such a tensor costs
            array = self._host_array(tensor, view_as)
        # The shape goes as the numpy tuple: msgpack writes tuples as arrays.
        return [name, array.shape, self._frame(array)]

    @staticmethod
    def _host_array(tensor: torch.Tensor, view_as: torch.dtype | None) -> np.ndarray:
        """The slow path: say why a tensor cannot go, or make it contiguous (one copy)."""
        if not tensor.is_cpu:
            raise Fault(
                f"tensor is on {tensor.device}; move it to the CPU before encoding "
                "(the wire carries host memory)"
            )
        if tensor.layout is not torch.strided:
            raise Fault(f"tensor layout {tensor.layout} is not supported; use .to_dense()")
        # detach: the wire carries values, not autograd history. resolve_*: lazily conjugated or
        # negated views cannot expose their memory. contiguous: the one copy a strided tensor
        # costs. Each is a no-op when it does not apply.
        tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
        return (tensor if view_as is None else tensor.view(view_as)).numpy()

    def _ndarray(self, array: np.ndarray, depth: int) -> list[Any]:
        if depth + 2 > DEFAULT_MAX_DEPTH:
            raise Fault(f"array nested deeper than {DEFAULT_MAX_DEPTH} levels")
        dtype = array.dtype
        if dtype.kind not in "biufc" or dtype.fields is not None:
            raise Fault(
                f"numpy dtype {dtype} cannot go on the wire: only bool, integer, float and "
                "complex arrays have a plain binary layout (object arrays would need pickle)"
            )
        if array.nbytes < self.threshold:
            # Small: inline, C-order bytes whatever the strides.
            return [dtype.str, array.shape, _ext_raw_view(array.tobytes())]
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)  # the one copy a non-contiguous array costs
        return [dtype.str, array.shape, self._frame(array)]

    def raw(self, name: str, shape: tuple[int, ...], data: memoryview) -> list[Any]:
        """``[name, shape, data]`` for bytes already laid out as the dtype ``name`` says (C order,
        1-D unsigned-byte view): inline below the threshold, else an aux frame viewing them. For
        callers that build such bytes more cheaply than an array (the request's token ids)."""
        if data.nbytes < self.threshold:
            return [name, shape, _ext_raw_view(data.tobytes())]
        self.frames.append(data)
        return [name, shape, len(self.frames) - 1]

    def _frame(self, array: np.ndarray) -> int:
        """Append a C-contiguous array's bytes as an aux frame; its index. The frame is a view of
        the array's (the tensor's) memory and keeps it alive: nothing is copied."""
        # memoryview.cast refuses shapes with a zero in them; an empty array has no bytes anyway
        # (it gets here only with threshold 0).
        frame = memoryview(array.data).cast("B") if array.nbytes else memoryview(b"")
        self.frames.append(frame)
        return len(self.frames) - 1

    def _other(self, obj: Any, depth: int) -> Any:
        # Subclasses of the plain types go as their plain value (IntEnum, StrEnum, torch.Size,
        # namedtuples, OrderedDict); anything else is refused rather than guessed at.
        if isinstance(obj, int):
            return int.__int__(obj)
        if isinstance(obj, float):
            return float.__float__(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, (list, tuple)):
            return self._sequence(obj, depth)
        if isinstance(obj, dict):
            return self._mapping(obj, depth)
        if isinstance(obj, np.generic):
            raise Fault(
                f"numpy scalar {type(obj).__name__} cannot go on the wire; use .item() for a "
                "Python number or np.asarray() for a 0-d array"
            )
        raise Fault(f"cannot encode an object of type {type(obj).__qualname__}")


def encode(obj: Any, *, threshold: int | None = None) -> list[Frame]:
    """Encode ``obj`` as a list of frames: frame 0 the msgpack body, then one frame per tensor
    whose byte size is at least the zero-copy threshold.

    ``obj`` may hold None, bool, int, float, str, bytes, lists (tuples go as lists), dicts with str
    keys, torch tensors (CPU, strided) and numpy arrays (bool/int/float/complex). ``threshold``
    defaults to `zero_copy_threshold()` (env ``MMPROC_ZERO_COPY_THRESHOLD``, else 256).

    Aux frames are 1-D unsigned-byte ``memoryview``s over the tensors' own memory: nothing is
    copied, and the views keep the tensors alive. Do not modify a tensor until its frames have
    been sent (see `mmproc.wire.RequestSender.send`, which returns a tracker for that).

    Raises `EncodeError` naming the offending value's path (``$.features[0].data``) for anything
    that cannot go on the wire, and `ConfigurationError` for a bad threshold.
    """
    return encode_tree(lambda encoder: encoder.walk(obj, 0), threshold)


def encode_tree(build: Callable[[TreeEncoder], Any], threshold: int | None) -> list[Frame]:
    """Internal to `mmproc.wire`: encode the tree ``build(encoder)`` returns. ``build`` lays out
    containers itself and passes values through ``encoder.value(obj, path)``, which swaps tensors
    for ``[dtype, shape, data]`` and checks everything it walks; what ``build`` puts in the tree
    directly must already be plain msgpack values."""
    encoder = TreeEncoder(zero_copy_threshold(threshold))
    try:
        tree = build(encoder)
    except Fault as fault:
        raise EncodeError(f"cannot encode {fault.where()}: {fault.reason}") from None
    try:
        body = msgpack.packb(tree, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:
        # msgpack's own limits (ints beyond 64 bits, bins over 4 GiB), or a value put in the tree
        # directly that msgpack cannot pack.
        raise EncodeError(f"msgpack cannot pack the object: {exc}") from exc
    frames = encoder.frames
    frames[0] = body
    return frames


# --- decoding -----------------------------------------------------------------------------------


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"DecodeLimits.{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds `decode` enforces on an untrusted message; all are checked before the work they
    bound is done. Bad values are a `ConfigurationError`."""

    max_frames: int = 4096
    """Most frames in one message, frame 0 included."""
    max_total_bytes: int = 1 << 30
    """Most bytes over all frames together (1 GiB)."""
    max_body_bytes: int = 16 << 20
    """Most bytes in frame 0, the msgpack body (16 MiB). Parsing builds Python objects, up to
    ~60x the bytes that describe them, so this is kept far below ``max_total_bytes``."""
    max_depth: int = DEFAULT_MAX_DEPTH
    """Deepest nesting of arrays and maps (a tensor takes two levels); at most 256."""
    max_containers: int = 1 << 18
    """Most arrays and maps in the body."""
    max_objects: int = 1 << 18
    """Most msgpack values in the body (scalars, arrays, maps and map keys): each becomes a Python
    object, and a body of many tiny values is parsed one value at a time (~0.2 us each)."""
    max_memory_ratio: int = 12
    """Most bytes of Python objects decoding may build per byte of the message (all frames), but
    never fewer than ``memory_allowance``: the parse of the body, tensor and array objects, the
    list of token ids. Every object is charged before it is built, at an upper bound of its size;
    a message that would need more is refused (``benchmarks/decode_memory.py`` prints the peak
    RSS growth against the message size)."""
    memory_allowance: int = MEMORY_ALLOWANCE
    """Bytes any message may use however small (256 KiB: 16x a 16 KiB message): a request body
    of up to ~0.9 KiB, whose worst case fits in it, is parsed in one C call without counting."""
    max_ndim: int = 32
    """Most dimensions in a tensor's shape."""
    max_prompt_tokens: int = 1 << 22
    """Most prompt token ids in one engine request (4,194,304). They arrive as one int64 array,
    possibly an aux frame that only ``max_total_bytes`` bounds, and each becomes a Python int
    (~36 bytes with its list slot): this keeps one message from costing gigabytes."""
    allowed_dtypes: frozenset[str] = DEFAULT_ALLOWED_DTYPES
    """Wire dtype names rebuilt; any other dtype is a `DecodeError`. Only plain binary element
    types (bool, integer, float, complex) can be allowed."""
    _dtypes: Mapping[str, DTypeSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "max_frames",
            "max_total_bytes",
            "max_body_bytes",
            "max_depth",
            "max_containers",
            "max_objects",
            "max_memory_ratio",
            "max_ndim",
            "max_prompt_tokens",
        ):
            _positive(name, getattr(self, name))
        allowance = self.memory_allowance
        if isinstance(allowance, bool) or not isinstance(allowance, int) or allowance < 0:
            raise ConfigurationError(
                f"DecodeLimits.memory_allowance must be an int >= 0 bytes, got {allowance!r}"
            )
        if self.max_depth > _DEPTH_CEILING:
            raise ConfigurationError(
                f"DecodeLimits.max_depth must be <= {_DEPTH_CEILING}, got {self.max_depth}"
            )
        try:
            allowed = frozenset(self.allowed_dtypes)
        except TypeError:
            allowed = None
        if (
            allowed is None
            or isinstance(self.allowed_dtypes, str)
            or not all(isinstance(name, str) for name in allowed)
        ):
            raise ConfigurationError("DecodeLimits.allowed_dtypes must be a set of dtype names")
        object.__setattr__(self, "allowed_dtypes", allowed)
        object.__setattr__(self, "_dtypes", build_dtype_table(allowed))


DEFAULT_LIMITS: Final = DecodeLimits()
"""The limits `decode` uses when none are given."""


class _Inline:
    """Internal marker for an ext-3 payload, so only the tensor position may hold one."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:  # error messages quote it
        return f"<ext type {EXT_RAW_VIEW}: {len(self.data)} raw bytes>"


_EXT_NAMES: Final = {1: "pickle", 2: "cloudpickle"}


def _ext_hook(code: int, data: bytes) -> _Inline:
    if code == EXT_RAW_VIEW:
        return _Inline(data)
    what = _EXT_NAMES.get(code)
    raise DecodeError(
        f"frame 0 holds msgpack ext type {code}"
        + (f" ({what}, which is never unpickled)" if what else "")
        + f"; only ext type {EXT_RAW_VIEW} (raw tensor bytes) is accepted"
    )


# torch warns once per process that a tensor over a read-only buffer is writable. Decoded tensors
# are read-only views by contract (module docstring), so on the first such decode that one warning
# is spent, silently, instead of reaching the user as noise.
_readonly_warning_spent = False


def _frombuffer(buffer: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    global _readonly_warning_spent
    if _readonly_warning_spent or (type(buffer) is memoryview and not buffer.readonly):
        return torch.frombuffer(buffer, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(buffer, dtype=dtype)
    _readonly_warning_spent = True
    return tensor


# What one decoded tensor or array costs besides its data (a view over a frame): the Python
# object, and for torch the tensor and storage implementations, rounded up.
_TORCH_TENSOR_BYTES: Final = 1280
_NUMPY_ARRAY_BYTES: Final = 384
# The shortest tensor in a body, ``[dtype, [], data]``, takes 7 bytes: tensor objects cost at most
# this much per byte of body.
_TENSOR_BYTES_PER_BYTE: Final = _TORCH_TENSOR_BYTES // 7 + 1


class _Decoder:
    """One decode call: validates the parsed tree and builds tensors over the frames."""

    __slots__ = ("budget", "dtypes", "frames", "limits", "max_depth", "max_ndim", "used")

    def __init__(
        self, limits: DecodeLimits, frames: list[memoryview], budget: MemoryBudget | None
    ) -> None:
        self.limits = limits
        self.budget = budget
        self.dtypes = limits._dtypes
        self.max_depth = limits.max_depth
        self.max_ndim = limits.max_ndim
        self.frames = frames
        self.used = bytearray(len(frames))

    def value(self, obj: Any, path: tuple[str | int, ...]) -> Any:
        """Check and convert one value found at ``path`` of a structure the caller reads itself."""
        try:
            return self.walk(obj, len(path))
        except Fault as fault:
            fault.path.extend(reversed(path))
            raise

    def tensor(self, obj: Any, path: tuple[str | int, ...]) -> Any:
        """Like `value`, for a place that must hold a tensor (or array)."""
        if type(obj) is list and len(obj) == 3:
            name, shape, data = obj
            if (
                type(name) is str
                and type(shape) is list
                and (type(data) is int or type(data) is _Inline)
            ):
                try:
                    return self._tensor(name, shape, data, len(path) + 1)
                except Fault as fault:
                    fault.path.extend(reversed(path))
                    raise
        error = Fault(f"expected a tensor [dtype, shape, data], got {short_repr(obj)}")
        error.path.extend(reversed(path))
        raise error

    def walk(self, obj: Any, depth: int) -> Any:
        """Check ``obj`` (nested ``depth`` containers deep) and build the tensors in it."""
        kind = type(obj)
        if kind in _PLAIN:
            return obj
        if kind is list:
            depth += 1
            if depth > self.max_depth:
                raise Fault(f"nested deeper than {self.max_depth} levels")
            if len(obj) == 3:
                head, shape, data = obj
                if (
                    type(head) is str
                    and type(shape) is list
                    and (type(data) is _Inline or (type(data) is int and is_dtype_name(head)))
                ):
                    return self._tensor(head, shape, data, depth)
            if set(map(type, obj)) <= _PLAIN:
                return obj
            for index, item in enumerate(obj):
                if type(item) not in _PLAIN:
                    try:
                        obj[index] = self.walk(item, depth)
                    except Fault as fault:
                        fault.path.append(index)
                        raise
            return obj
        if kind is dict:
            depth += 1
            if depth > self.max_depth:
                raise Fault(f"nested deeper than {self.max_depth} levels")
            for key, value in obj.items():
                if type(key) is not str:
                    raise Fault(f"map key {short_repr(key)} is {type(key).__name__}, not str")
                if type(value) not in _PLAIN:
                    try:
                        # Replacing the value of an existing key is safe while iterating.
                        obj[key] = self.walk(value, depth)
                    except Fault as fault:
                        fault.path.append(key)
                        raise
            return obj
        if kind is _Inline:
            raise Fault(f"ext type {EXT_RAW_VIEW} (raw tensor bytes) outside a tensor")
        if kind is msgpack.Timestamp:
            raise Fault("msgpack timestamp (ext type -1) is not accepted")
        raise Fault(f"unexpected {kind.__name__} value")

    def _tensor(self, name: str, shape: list[Any], data: _Inline | int, depth: int) -> Any:
        if depth + 1 > self.max_depth:
            raise Fault(f"tensor shape nested deeper than {self.max_depth} levels")
        spec = self.dtypes.get(name)
        if spec is None:
            known = "not allowed" if is_dtype_name(name) else "not a known dtype"
            raise Fault(f"tensor dtype {short_repr(name)} is {known}")
        if len(shape) > self.max_ndim:
            raise Fault(f"tensor has {len(shape)} dimensions, more than {self.max_ndim}")
        itemsize = spec.itemsize
        numel = 1
        extent = itemsize
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise Fault(f"tensor shape {short_repr(shape)} has a dimension {short_repr(dim)}")
            numel *= dim
            if dim:
                extent *= dim
                if extent > _MAX_EXTENT:
                    raise Fault(f"tensor shape {short_repr(shape)} is too large to represent")
        if isinstance(data, _Inline):
            buffer: bytes | memoryview = data.data
        else:
            frames = self.frames
            if not 0 < data < len(frames):
                raise Fault(
                    f"tensor refers to frame {data}, but the message has frames 1.."
                    f"{len(frames) - 1} for tensor data"
                )
            used = self.used
            if used[data]:
                raise Fault(f"frame {data} is referenced by more than one tensor")
            used[data] = 1
            buffer = frames[data]
        nbytes = len(buffer)
        if numel * itemsize != nbytes:
            source = "its inline bytes" if type(data) is _Inline else f"frame {data}"
            raise Fault(
                f"tensor {name} {shape} needs {numel * itemsize} bytes but {source} holds {nbytes}"
            )
        # A bool byte other than 0 or 1 is no value torch or numpy define. Bool tensors are small
        # (masks such as is_embed), so checking them costs next to nothing: inline bytes with one
        # C-level pass (translate leaves nothing when every byte is 0 or 1), frames with numpy.
        if spec.boolean and nbytes:
            if type(buffer) is bytes:
                bad = len(buffer.translate(None, b"\x00\x01")) > 0
            else:
                bad = np.frombuffer(buffer, dtype=np.uint8).max() > 1
            if bad:
                raise Fault(f"tensor {name} {shape} holds bytes other than 0 and 1")
        torch_dtype = spec.torch_dtype
        budget = self.budget
        if budget is not None:  # None: the message is too small for the worst case to matter
            budget.charge(_TORCH_TENSOR_BYTES if torch_dtype is not None else _NUMPY_ARRAY_BYTES)
        try:
            if torch_dtype is not None:
                if nbytes == 0:  # torch.frombuffer refuses empty buffers; nothing to share
                    return torch.empty(shape, dtype=torch_dtype)
                if _readonly_warning_spent:
                    flat = torch.frombuffer(buffer, dtype=torch_dtype)
                else:
                    flat = _frombuffer(buffer, torch_dtype)
                # view(*dims) is the cheapest reshape torch offers (a list argument costs more).
                if len(shape) == 1:
                    return flat
                return flat.view(*shape) if shape else flat.view(())
            array = np.frombuffer(buffer, dtype=spec.numpy_dtype).reshape(shape)
        except (RuntimeError, ValueError, TypeError) as exc:
            # Unreachable after the checks above; kept so a torch/numpy surprise is still a
            # DecodeError and never crashes the receiver.
            raise Fault(f"cannot build tensor {name} {short_repr(shape)}: {exc}") from None
        array.flags.writeable = False
        return array


def _frame_views(frames: Sequence[Any], limits: DecodeLimits) -> tuple[list[memoryview], int]:
    """The frames as flat byte views, and their total size, within the frame and byte limits."""
    try:
        count = len(frames)
    except TypeError:
        raise DecodeError(
            f"frames must be a sequence of buffers, got {type(frames).__name__}"
        ) from None
    if count == 0:
        raise DecodeError("message has no frames: frame 0 (the msgpack body) is missing")
    if count > limits.max_frames:
        raise DecodeError(f"message has {count} frames, more than the limit of {limits.max_frames}")
    views: list[memoryview] = []
    total = 0
    for index in range(count):
        frame = frames[index]
        try:
            view = memoryview(frame)
        except TypeError:
            raise DecodeError(f"frame {index} is a {type(frame).__name__}, not a buffer") from None
        if view.format != "B" or view.ndim != 1:
            if not view.c_contiguous:
                raise DecodeError(f"frame {index} is not a contiguous buffer")
            view = view.cast("B") if view.nbytes else memoryview(b"")
        total += view.nbytes
        if total > limits.max_total_bytes:
            raise DecodeError(
                f"message is larger than the limit of {limits.max_total_bytes} bytes "
                f"(reached at frame {index})"
            )
        views.append(view)
    if views[0].nbytes > limits.max_body_bytes:
        raise DecodeError(
            f"frame 0 (the msgpack body) has {views[0].nbytes} bytes, more than the limit of "
            f"{limits.max_body_bytes}"
        )
    return views, total


def decode(frames: Sequence[Any], *, limits: DecodeLimits | None = None) -> Any:
    """Decode a message made by `encode`: ``frames[0]`` the msgpack body, the rest aux frames.

    Frames may be any buffers (``bytes``, ``memoryview``, ``zmq.Frame``). Tensors come back as
    **read-only views** over the frames, without a copy: a torch tensor for a torch dtype name, a
    numpy array (flagged read-only) for a numpy dtype string. They keep their frames alive.

    Every check in `DecodeLimits` (``limits``, default `DEFAULT_LIMITS`) is applied; a malformed
    message raises `DecodeError` saying what was wrong and where, never another exception.
    """
    return decode_tree(frames, limits, _walk_all)


def _walk_all(tree: Any, decoder: _Decoder) -> Any:
    return decoder.walk(tree, 0)


def decode_tree(
    frames: Sequence[Any],
    limits: DecodeLimits | None,
    build: Callable[[Any, _Decoder], _T],
    *,
    root_map: str | None = None,
    build_cost: tuple[int, int] = (0, 0),
) -> _T:
    """Internal to `mmproc.wire`: check and parse ``frames``, then return ``build(tree,
    decoder)``. ``tree`` is the raw msgpack tree, nothing in it checked or converted yet;
    ``build`` passes the parts it does not check itself through ``decoder.value(obj, path)`` or
    ``decoder.tensor(obj, path)``. Afterwards every aux frame must have been used.

    With ``root_map`` (what the message is, for the error), frame 0 must hold a map: checked on
    its first byte, before anything is parsed. ``build_cost`` bounds what ``build`` itself
    allocates: bytes per byte of body, plus bytes per byte of the whole message. When
    ``decoder.budget`` is not None it must charge that there (None: the message is small enough
    for its worst case to fit)."""
    if limits is None:
        limits = DEFAULT_LIMITS
    views, total = _frame_views(frames, limits)
    body = views[0]
    size = body.nbytes
    if root_map is not None and not (size and body[0] in MAP_HEADERS):
        got = describe_first_byte(body[0]) if size else "nothing"
        raise DecodeError(f"{root_map} must be a map, got a msgpack {got} (frame 0 byte 0)")
    budget: MemoryBudget | None = None
    try:
        # The common case: a body small next to the whole message (its tensors travel as
        # frames), whose worst case -- every byte an empty list, or a tensor -- fits the budget
        # with room to spare. Then nothing needs counting.
        per_body_byte, per_byte = build_cost
        worst = size * (WORST_BYTES_PER_BYTE + _TENSOR_BYTES_PER_BYTE + per_body_byte)
        if (
            worst + total * per_byte
            <= max(limits.max_memory_ratio * total, limits.memory_allowance)
            and size <= limits.max_objects
        ):
            tree = parse_whole(body, limits.max_containers, _ext_hook)
        else:
            budget = MemoryBudget(limits.max_memory_ratio, total, limits.memory_allowance)
            tree = parse_body(
                body,
                budget=budget,
                max_objects=limits.max_objects,
                max_containers=limits.max_containers,
                max_depth=limits.max_depth,
                ext_hook=_ext_hook,
            )
    except DecodeError:
        raise
    except Fault as fault:
        raise DecodeError(f"malformed message at {fault.where()}: {fault.reason}") from None
    except Exception as exc:
        # msgpack signals bad input with ValueError, TypeError, UnicodeDecodeError, StackError,
        # ExtraData, OutOfData...; all of them mean the same thing here.
        raise DecodeError(
            f"frame 0 is not a valid msgpack body: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    decoder = _Decoder(limits, views, budget)
    try:
        result = build(tree, decoder)
    except Fault as fault:
        raise DecodeError(f"malformed message at {fault.where()}: {fault.reason}") from None
    if len(views) > 1 and not all(decoder.used[1:]):
        unused = [index for index in range(1, len(views)) if not decoder.used[index]]
        raise DecodeError(
            f"frames {unused[:8]}{'...' if len(unused) > 8 else ''} are not referenced by any "
            "tensor in the body"
        )
    return result
