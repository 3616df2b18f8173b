"""Bounded parsing of a message's msgpack body (frame 0) into the raw tree the codec then checks.

msgpack builds a Python object for every value, and a value may take a single byte: an empty list
is one byte on the wire and ~80 in memory, an int in ``[-32, -6]`` one byte and ~40. Left alone,
a 16 MiB body of such bytes costs a gigabyte before anything can look at it. So nothing here is
built before it has been paid for:

* **counts** -- at most ``max_objects`` values (map keys included), of them at most
  ``max_containers`` arrays and maps, nested at most ``max_depth`` deep;
* **bytes** -- a `MemoryBudget` of ``ratio x the message's size``, but never less than a fixed
  allowance, shared with the rest of decoding (tensor objects, token ids). Every object is
  charged before it is built, at an upper bound of what it costs (a container's slots, a
  string's worst encoding in memory), and refunded to its real size once built.

Two ways through, chosen by the budget alone:

* **whole** -- a body whose worst case (`WORST_BYTES_PER_BYTE` per byte) fits the budget with as
  much again to spare, for what decoding builds next, is parsed by msgpack in one C call and
  charged that worst case (`parse_whole`; the codec does not even charge it when the worst case
  of the whole decode fits). Every request whose tensors travel as frames takes this path: their
  bytes raise the budget, and its body is small.
* **value by value** -- any other body is read here, one value at a time, by its first bytes: an
  array or a map by its header (so its slots are charged before they exist, and its depth is
  known), a scalar by its type and length. This costs 0.1 to 1 us a value instead of ~0.01, on
  bodies that are mostly values rather than bytes; ``max_objects`` bounds that time. It reads
  what msgpack reads (strict UTF-8, str or bin map keys) and builds the same tree.

Map keys are str or bin, as msgpack's ``strict_map_key`` has them; on the value-by-value path they
are not interned (msgpack interns the keys it puts in a map, which would grow the interpreter's
interned-string table, for good, by every distinct key of every message).

Whatever is wrong raises `Fault` (a reason and the path to where it was) or one of msgpack's own
exceptions; the codec turns both into `mmproc.errors.DecodeError`.
"""

from __future__ import annotations

import reprlib
import struct
import sys
from collections.abc import Callable
from typing import Any, Final

import msgpack

__all__ = [
    "MAP_HEADERS",
    "MEMORY_ALLOWANCE",
    "WORST_BYTES_PER_BYTE",
    "Fault",
    "MemoryBudget",
    "describe_first_byte",
    "parse_body",
    "parse_whole",
    "short_repr",
]

WORST_BYTES_PER_BYTE: Final = 96
"""Most bytes of Python objects msgpack builds for one byte of body, whatever the bytes: an empty
array or map (one byte, a 56- or 64-byte object plus its slot, rounded up by the allocator) is the
worst case, at ~80."""

MEMORY_ALLOWANCE: Final = 256 << 10
"""Bytes any message may use, however small (16x a 16 KiB message). A message needs a few objects
whatever its size (its token ids, a tensor object or two), and a receiver decodes one message at
a time, so this much is never a threat; with it, a request body of up to ~0.9 KiB is parsed in one
C call, uncounted, since even its worst case fits."""


# --- faults carry the path to where they happened -------------------------------------------------


class Fault(Exception):
    """What was wrong in a message, plus the path to it, collected innermost first while
    unwinding (the wire modules raise it; the decoders turn it into their public errors)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path: list[Any] = []

    def where(self) -> str:
        parts = ["$"]
        for step in reversed(self.path):
            if isinstance(step, int):
                parts.append(f"[{step}]")
            elif isinstance(step, str) and step.isidentifier() and len(step) <= 64:
                parts.append(f".{step}")
            else:
                parts.append(f"[{repr(step)[:64]}]")
        return "".join(parts)


# Error messages quote values from untrusted messages: reprlib bounds the work and the length
# (a plain repr of a 16 MiB string or a deep list would cost as much as the attack it reports).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 48
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6
_REPR.maxlevel = 3


def short_repr(value: object) -> str:
    """A short, bounded-cost repr of a value from a message, for error messages."""
    return _REPR.repr(value)


# --- the budget -----------------------------------------------------------------------------------


class MemoryBudget:
    """Bytes of Python objects one decode may still build: charged before each is built.

    ``limit`` is ``max(ratio * message_bytes, allowance)``; `charge` raises `Fault` when a
    charge would take more than what is left, and `refund` gives back what an upper-bound charge
    turned out not to need.
    """

    __slots__ = ("allowance", "limit", "ratio", "remaining")

    def __init__(self, ratio: int, message_bytes: int, allowance: int = MEMORY_ALLOWANCE) -> None:
        self.ratio = ratio
        self.allowance = allowance
        self.limit = max(ratio * message_bytes, allowance)
        self.remaining = self.limit

    def charge(self, nbytes: int) -> None:
        """Take ``nbytes`` from the budget, or raise `Fault` if fewer are left."""
        remaining = self.remaining - nbytes
        if remaining < 0:
            raise Fault(
                f"decoding would build more than {self.limit} bytes of objects, the limit for "
                f"this message ({self.ratio} x its size, at least {self.allowance}; "
                "DecodeLimits.max_memory_ratio)"
            )
        self.remaining = remaining

    def refund(self, nbytes: int) -> None:
        """Give back ``nbytes`` an earlier charge reserved and did not use."""
        self.remaining += nbytes


# --- what each first byte of a value costs --------------------------------------------------------

# Kinds of value by their first byte.
_FREE, _FIXED, _STR, _BIN, _EXT, _ARRAY, _MAP, _INVALID = range(8)

# Costs of objects, in bytes, rounded up to the allocator's 16-byte classes.
_SLOT: Final = 8
_INT: Final = 32  # a PyLong of one or two 30-bit digits
_BIG_INT: Final = 48  # a PyLong of three digits (64-bit values)
_FLOAT: Final = 32
_LIST: Final = 80  # the list object plus its separately allocated slot array's rounding
_BYTES: Final = 48
_INLINE: Final = 48  # the codec's holder of an ext payload
_TIMESTAMP: Final = 64
# A str of n UTF-8 bytes: at most n characters, 4 bytes each, and the decoder may hold a narrower
# copy while widening.
_STR_HEAD: Final = 96
_STR_PER_BYTE: Final = 6
# A dict built by insertion peaks, just after growing, at ~66 bytes an entry (old and new table).
_DICT_HEAD: Final = 256
_DICT_PER_ENTRY: Final = 80
_EMPTY_DICT: Final = 80


def _kinds() -> tuple[tuple[int, ...], tuple[int, ...]]:
    kind = [_INVALID] * 256
    cost = [0] * 256
    for byte in range(0x00, 0x80):  # positive fixint: cached ints
        kind[byte] = _FREE
    for byte in range(0x80, 0x90):
        kind[byte] = _MAP
    for byte in range(0x90, 0xA0):
        kind[byte] = _ARRAY
    for byte in range(0xA0, 0xC0):
        kind[byte] = _STR
    for byte in (0xC0, 0xC2, 0xC3, 0xCC):  # nil, false, true, uint8 (cached ints)
        kind[byte] = _FREE
    for byte in (0xC4, 0xC5, 0xC6):
        kind[byte] = _BIN
    for byte in (0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8):
        kind[byte] = _EXT
    for byte, price in (
        (0xCA, _FLOAT),
        (0xCB, _FLOAT),
        (0xCD, _INT),
        (0xCE, _INT),
        (0xCF, _BIG_INT),
        (0xD0, _INT),
        (0xD1, _INT),
        (0xD2, _INT),
        (0xD3, _BIG_INT),
    ):
        kind[byte], cost[byte] = _FIXED, price
    for byte in (0xD9, 0xDA, 0xDB):
        kind[byte] = _STR
    for byte in (0xDC, 0xDD):
        kind[byte] = _ARRAY
    for byte in (0xDE, 0xDF):
        kind[byte] = _MAP
    for byte in range(0xE0, 0x100):  # negative fixint: -5..-1 are cached, the others not
        kind[byte], cost[byte] = (_FREE, 0) if byte >= 0xFB else (_FIXED, _INT)
    return tuple(kind), tuple(cost)


_KIND, _COST = _kinds()

# Where the payload length of a str / bin / ext value is: bytes of the length field after the
# first byte, or the fixed length of a fixext.
_LENGTH_FIELD: Final = {
    **{0xD9: 1, 0xDA: 2, 0xDB: 4},  # str 8 / 16 / 32
    **{0xC4: 1, 0xC5: 2, 0xC6: 4},  # bin 8 / 16 / 32
    **{0xC7: 1, 0xC8: 2, 0xC9: 4},  # ext 8 / 16 / 32
}
_FIXEXT_LENGTH: Final = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}

_KIND_NAMES: Final = {
    _STR: "str",
    _BIN: "bin",
    _EXT: "ext",
    _ARRAY: "array",
    _MAP: "map",
    _INVALID: "never-used byte",
}


def _rounded(nbytes: int) -> int:
    return (nbytes + 15) & ~15


def describe_first_byte(byte: int) -> str:
    """What kind of msgpack value starts with ``byte`` (for error messages)."""
    kind = _KIND[byte]
    if kind in (_FREE, _FIXED):
        if byte == 0xC0:
            return "nil"
        if byte in (0xC2, 0xC3):
            return "bool"
        return "float" if byte in (0xCA, 0xCB) else "int"
    return _KIND_NAMES[kind]


MAP_HEADERS: Final = frozenset(byte for byte in range(256) if _KIND[byte] == _MAP)
"""First bytes of msgpack maps."""


# --- parsing --------------------------------------------------------------------------------------


def parse_body(
    body: memoryview,
    *,
    budget: MemoryBudget,
    max_objects: int,
    max_containers: int,
    max_depth: int,
    ext_hook: Callable[[int, bytes], Any],
) -> Any:
    """The raw msgpack tree of ``body`` (lists, str-or-bytes-keyed dicts, scalars, ``ext_hook``
    results), built within ``budget`` and the counts; raises `Fault` or msgpack's exceptions."""
    size = body.nbytes
    worst = size * WORST_BYTES_PER_BYTE
    # Whole only if the worst case leaves at least as much again for what decoding builds next
    # (tensor objects, token ids). Every value takes at least one byte, so a body no longer than
    # max_objects cannot hold more values.
    if 2 * worst <= budget.remaining and size <= max_objects:
        budget.charge(worst)
        return parse_whole(body, max_containers, ext_hook)
    return _Walker(body, budget, max_objects, max_containers, max_depth, ext_hook).root()


def parse_whole(
    body: memoryview, max_containers: int, ext_hook: Callable[[int, bytes], Any]
) -> Any:
    """The raw msgpack tree of ``body`` in one C call, charging nothing: for a caller that has
    made sure the budget covers `WORST_BYTES_PER_BYTE` per byte of it, and that the body is no
    longer than ``max_objects``. Arrays and maps are still counted against ``max_containers``."""
    if body.nbytes <= max_containers:
        # Every array and map takes at least one byte of the body, so a body this small cannot
        # hold more than max_containers of them: the counting hooks (one Python call per
        # container) would never fire, and are left out.
        return msgpack.unpackb(
            body,
            use_list=True,
            raw=False,
            strict_map_key=True,
            timestamp=0,
            ext_hook=ext_hook,
        )
    count = _container_count(max_containers)
    return msgpack.unpackb(
        body,
        use_list=True,
        raw=False,
        strict_map_key=True,
        timestamp=0,
        ext_hook=ext_hook,
        list_hook=count,
        object_hook=count,
    )


def _container_count(limit: int) -> Callable[[Any], Any]:
    remaining = limit

    def count(container: Any) -> Any:
        nonlocal remaining
        remaining -= 1
        if remaining < 0:
            raise Fault(f"frame 0 holds more than {limit} arrays and maps")
        return container

    return count


# Fixed-size scalars: their struct formats, by first byte.
_NUMBERS: Final = {
    0xCA: struct.Struct(">f"),
    0xCB: struct.Struct(">d"),
    0xCD: struct.Struct(">H"),
    0xCE: struct.Struct(">I"),
    0xCF: struct.Struct(">Q"),
    0xD0: struct.Struct(">b"),
    0xD1: struct.Struct(">h"),
    0xD2: struct.Struct(">i"),
    0xD3: struct.Struct(">q"),
}
_EXT_CODE: Final = struct.Struct(">b")
_TIMESTAMP_CODE: Final = -1
# The walk's own cost: its frames, and if it refuses, the traceback and the message (the partly
# built tree lives until the error has been raised).
_WALKER: Final = 16 << 10


class _Walker:
    """One value-by-value parse of a body: each value's first bytes say what it is and what it
    will cost, which is charged before the value is built."""

    __slots__ = (
        "body",
        "budget",
        "containers",
        "ext_hook",
        "max_containers",
        "max_depth",
        "max_objects",
        "objects",
        "position",
        "size",
    )

    def __init__(
        self,
        body: memoryview,
        budget: MemoryBudget,
        max_objects: int,
        max_containers: int,
        max_depth: int,
        ext_hook: Callable[[int, bytes], Any],
    ) -> None:
        self.body = body
        self.size = body.nbytes
        self.budget = budget
        self.max_objects = max_objects
        self.max_containers = max_containers
        self.max_depth = max_depth
        self.objects = max_objects
        self.containers = max_containers
        self.ext_hook = ext_hook
        self.position = 0
        budget.charge(_WALKER)

    def root(self) -> Any:
        tree = self.value(0)
        end = self.position
        if end != self.size:
            raise msgpack.ExtraData(tree, bytes(self.body[end : end + 16]))
        return tree

    def _too_many_values(self) -> Fault:
        return Fault(
            f"frame 0 holds more than {self.max_objects} values (DecodeLimits.max_objects)"
        )

    def _take(self, count: int) -> int:
        """Start of the next ``count`` bytes, which must be in the body; moves past them."""
        start = self.position
        end = start + count
        if end > self.size:
            raise msgpack.OutOfData(f"frame 0 ends inside the value at offset {start}")
        self.position = end
        return start

    def _open(self, depth: int, count: int, per_item: int) -> None:
        """Account for a container of ``count`` items (each at least ``per_item`` values and
        bytes) about to be built ``depth`` deep: refused before its slots exist."""
        if depth > self.max_depth:
            raise Fault(f"nested deeper than {self.max_depth} levels")
        self.containers -= 1
        if self.containers < 0:
            raise Fault(f"frame 0 holds more than {self.max_containers} arrays and maps")
        if count * per_item > self.objects:
            raise self._too_many_values()
        left = self.size - self.position
        if count * per_item > left:
            raise Fault(f"a container claims {count} items but only {left} bytes follow it")

    def value(self, depth: int) -> Any:
        """Parse the next value (``depth`` containers deep), charging it first."""
        self.objects -= 1
        if self.objects < 0:
            raise self._too_many_values()
        position = self._take(1)
        first = self.body[position]
        kind = _KIND[first]
        if kind == _FREE:
            if first < 0x80:
                return first
            if first >= 0xE0:
                return first - 0x100
            if first == 0xC0:
                return None
            if first == 0xCC:
                return self.body[self._take(1)]
            return first == 0xC3
        if kind == _FIXED:
            if first >= 0xE0:
                self.budget.charge(_INT)
                return first - 0x100
            self.budget.charge(_COST[first])
            number = _NUMBERS[first]
            return number.unpack_from(self.body, self._take(number.size))[0]
        if kind == _ARRAY:
            return self._array(first, depth + 1)
        if kind == _MAP:
            return self._map(first, depth + 1)
        if kind == _INVALID:
            raise msgpack.FormatError(f"byte 0x{first:02x} at offset {position} starts no value")
        return self._sized(kind, first)

    def _length(self, first: int, fixed_mask: int) -> int:
        if first < 0xC0:  # fixstr
            return first & fixed_mask
        fixext = _FIXEXT_LENGTH.get(first)
        if fixext is not None:
            return fixext
        width = _LENGTH_FIELD[first]
        return int.from_bytes(self.body[self._take(width) : self.position], "big")

    def _sized(self, kind: int, first: int) -> Any:
        """A str, bin or ext value: its length is in its header, its cost follows from it."""
        length = self._length(first, 0x1F)
        budget = self.budget
        body = self.body
        if kind == _STR:
            reserve = _STR_HEAD + _STR_PER_BYTE * length
            budget.charge(reserve)
            start = self._take(length)
            text = str(body[start : start + length], "utf-8")
            budget.refund(reserve - _rounded(sys.getsizeof(text)))
            return text
        if kind == _BIN:
            budget.charge(_BYTES + _rounded(length))
            start = self._take(length)
            return bytes(body[start : start + length])
        code = _EXT_CODE.unpack_from(body, self._take(1))[0]
        budget.charge(_BYTES + _INLINE + _TIMESTAMP + _rounded(length))
        start = self._take(length)
        data = bytes(body[start : start + length])
        if code == _TIMESTAMP_CODE:  # as msgpack reads it: the codec refuses it, by name
            return msgpack.Timestamp.from_bytes(data)
        return self.ext_hook(code, data)

    def _count(self, first: int, width16: int) -> int:
        if first & 0xF0 in (0x80, 0x90):  # fixmap / fixarray
            return first & 0x0F
        width = 2 if first == width16 else 4
        return int.from_bytes(self.body[self._take(width) : self.position], "big")

    def _array(self, first: int, depth: int) -> list[Any]:
        count = self._count(first, 0xDC)
        self._open(depth, count, 1)
        budget = self.budget
        budget.charge(_LIST + _SLOT * count)
        items: list[Any] = [None] * count
        # Scalars (most items of a long array) are taken inline: no call per item.
        body, kinds, costs, numbers = self.body, _KIND, _COST, _NUMBERS
        index = 0
        try:
            for index in range(count):
                position = self.position
                if position >= self.size:
                    raise msgpack.OutOfData(f"frame 0 ends inside the array item {index}")
                first = body[position]
                kind = kinds[first]
                if first < 0x80 or first >= 0xE0:  # a fixint
                    self.objects -= 1
                    if self.objects < 0:
                        raise self._too_many_values()
                    if first < 0x80:
                        items[index] = first
                    else:
                        budget.charge(costs[first])
                        items[index] = first - 0x100
                    self.position = position + 1
                elif first == 0x90 or first == 0x80:  # an empty array or map: no header to read
                    self.objects -= 1
                    if self.objects < 0:
                        raise self._too_many_values()
                    self._open(depth + 1, 0, 1)
                    budget.charge(_LIST if first == 0x90 else _EMPTY_DICT)
                    items[index] = [] if first == 0x90 else {}
                    self.position = position + 1
                elif kind == _FIXED:
                    self.objects -= 1
                    if self.objects < 0:
                        raise self._too_many_values()
                    budget.charge(costs[first])
                    number = numbers[first]
                    self.position = position + 1
                    items[index] = number.unpack_from(body, self._take(number.size))[0]
                else:
                    items[index] = self.value(depth)
        except Fault as fault:
            fault.path.append(index)
            raise
        return items

    def _map(self, first: int, depth: int) -> dict[Any, Any]:
        count = self._count(first, 0xDE)
        self._open(depth, count, 2)
        budget = self.budget
        reserve = _DICT_HEAD + _DICT_PER_ENTRY * count
        budget.charge(reserve)
        body = self.body
        out: dict[Any, Any] = {}
        for index in range(count):
            position = self.position
            if position >= self.size:
                raise msgpack.OutOfData(f"frame 0 ends inside map entry {index}")
            kind = _KIND[body[position]]
            if kind != _STR and kind != _BIN:
                raise Fault(
                    f"map key {index} is a msgpack {describe_first_byte(body[position])}; only "
                    "str keys are accepted"
                )
            key = self.value(depth)
            try:
                out[key] = self.value(depth)
            except Fault as fault:
                fault.path.append(key)
                raise
        budget.refund(reserve - _rounded(sys.getsizeof(out)))
        return out
