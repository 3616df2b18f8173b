"""Media items by reference: what names an item on the wire, and what each end keeps of them.

In a multi-turn chat every request carries every earlier image again. So a receiver keeps the
items it has received (`ItemCache`, a byte-bounded LRU) and tells the sender, in each
acknowledgement, which of the request's items it holds now; the sender remembers that
(`HeldItems`, bounded likewise) and sends such an item again as a *reference*: its key and its
placement in the prompt, no tensors. The receiver fills references in from its cache before the
engine sees the request.

What the sender knows of the receiver's cache is only ever a guess: the receiver evicts on its
own (other senders fill it), restarts empty, or is another receiver than the last one. A
reference the receiver does not hold makes it answer the whole request as *missing items*
(`MissingItemsError`: not delivered, and not refused as malformed), and the sender sends the
request again at once with every item in full, which cannot be answered so. A wrong guess costs
one round trip and one full send, never a lost or wrong request. A request's references are
resolved before its full items are stored, and it keeps what it was filled with, so eviction
while a request is decoded changes nothing.

An item's key (`item_key`) names its content and its wire form: a digest of the feature's
``hash`` (content, model and processing options, as the front end's processor hashed it), its
modality, its norm spec and each tensor's name, dtype and shape. Two senders whose items share
a hash but not a form (one normalises on the CPU and ships floats, the other ships uint8 with a
spec) have different keys, so neither is ever served the other's tensors. The content itself is
identified by the hash, as the engine's own caches (encoder outputs, prefix blocks) identify it;
see `mmproc.hashing` for how far a hash can be trusted (blake3 by default).

Items smaller than `MIN_ITEM_BYTES` always travel in full: a reference would save next to
nothing and could cost a round trip.

A sender need not keep the tensors of an item the receiver holds: a *stand-in* feature
(`is_stand_in`: its tensors are ``torch`` meta tensors, names, dtypes and shapes without memory)
keys as the item does and goes as its reference. A stand-in cannot go in full, so where the
receiver is not known to hold it (`StandInsNotHeldError`, nothing sent) or answers that it no
longer does (a `mmproc.wire.DeliveryFailure` with ``missing`` set), its caller must make the
item's tensors again and send the request anew.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Generic, Protocol, TypeVar

import msgpack
import torch

from mmproc.errors import ConfigurationError, DecodeError
from mmproc.wire.dtypes import TORCH_ENCODING

__all__ = [
    "DEFAULT_ITEM_CACHE_BYTES",
    "ITEM_ENTRY_BYTES",
    "ITEM_KEY_BYTES",
    "MIN_ITEM_BYTES",
    "HeldItems",
    "ItemCache",
    "MissingItemsError",
    "StandInsNotHeldError",
    "is_stand_in",
    "item_key",
    "item_nbytes",
]

DEFAULT_ITEM_CACHE_BYTES: Final = 1 << 30
"""Default ``item_cache_bytes`` of `mmproc.wire.RequestReceiver` (the tensor bytes it keeps) and
of `mmproc.wire.RequestSender` (the bytes of items it assumes a receiver keeps): 1 GiB, ~230
1024x768 Qwen2-VL images. Keep the two equal; 0 on either end turns references off."""

ITEM_KEY_BYTES: Final = 16
"""Length of an item key (a BLAKE2b digest)."""

ITEM_ENTRY_BYTES: Final = 1024
"""What one kept item costs besides its tensors' bytes (its objects, its key, its LRU slot):
charged with the tensors, so that many small items cannot outgrow the bound either."""

MIN_ITEM_BYTES: Final = 4096
"""Items whose tensors take fewer bytes are always sent in full and never kept."""

_KEY_MAGIC: Final = "mmproc-item-ref/1"

_V = TypeVar("_V")


class WireItem(Protocol):
    """What this module reads of a feature: `mmproc.wire.WireFeature` is one. (A protocol, so
    that the request schema can use this module without this module using it.)"""

    @property
    def modality(self) -> str: ...
    @property
    def item_index(self) -> int: ...
    @property
    def hash(self) -> str: ...
    @property
    def data(self) -> Mapping[str, torch.Tensor]: ...
    @property
    def norm(self) -> Mapping[str, Any] | None: ...


def item_nbytes(feature: WireItem) -> int:
    """Bytes of the feature's tensors (``data``): what keeping it costs, besides
    `ITEM_ENTRY_BYTES`."""
    return sum(tensor.nbytes for tensor in feature.data.values())


def item_key(feature: WireItem) -> bytes:
    """The key that names ``feature``'s item on the wire: a 16-byte digest of its hash, its
    modality, its norm spec and each tensor's name, dtype and shape (see the module docs).

    The sender computes it from the request it sends, the receiver from the feature it decoded:
    msgpack writes a tuple as it writes a list, so both get the same bytes."""
    try:
        tensors = feature.data.values()
        packed = msgpack.packb(
            [
                _KEY_MAGIC,
                feature.modality,
                feature.hash,
                feature.norm,
                list(feature.data),
                [_dtype_name(tensor.dtype) for tensor in tensors],
                [tuple(tensor.shape) for tensor in tensors],
            ],
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        # Only a feature whose norm was changed after construction gets here.
        raise ValueError(
            f"cannot key {feature.modality} item {feature.item_index}: {exc}"
        ) from None
    return hashlib.blake2b(packed, digest_size=ITEM_KEY_BYTES).digest()


def _dtype_name(dtype: torch.dtype) -> str:
    encoding = TORCH_ENCODING.get(dtype)
    return str(dtype) if encoding is None else encoding[0]


def check_cache_bytes(owner: str, value: object) -> int:
    """Internal: ``item_cache_bytes`` if it is an int >= 0, else a `ConfigurationError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"{owner} item_cache_bytes must be an int >= 0 (0 turns references off), got {value!r}"
        )
    return value


def is_stand_in(feature: WireItem) -> bool:
    """Whether ``feature`` stands in for an item the receiver holds: some tensor of its
    ``data`` is a ``torch`` meta tensor (a name, dtype and shape, no memory to send)."""
    return any(tensor.is_meta for tensor in feature.data.values())


class StandInsNotHeldError(Exception):
    """A request's stand-in items (`is_stand_in`) cannot go by reference: the sender does not
    take the receiver to hold them (it never said so, or evicted them, or lacked them since),
    and they have no tensors to go in full. Nothing was sent; make their tensors again."""

    def __init__(self, request_id: str, hashes: Sequence[str]) -> None:
        self.reason = (
            f"{len(hashes)} item(s) have no tensors here and the receiver is not known to hold "
            f"them (hash {', '.join(hashes[:4])})"
        )
        """Why, in words, without the request id."""
        super().__init__(f"engine request {request_id}: {self.reason}")
        self.request_id = request_id
        self.hashes: tuple[str, ...] = tuple(hashes)
        """The ``hash`` of each such item, in request order."""


class MissingItemsError(DecodeError):
    """A request refers to items this receiver does not hold (evicted, never received, or sent
    to another receiver). Not malformed: its sender sends it again with every item in full."""

    def __init__(self, message: str, positions: Sequence[int]) -> None:
        super().__init__(message)
        self.positions: tuple[int, ...] = tuple(positions)
        """Positions in ``features`` of the references that were not held."""


class _ByteBoundedLRU(Generic[_V]):
    """Values by item key, least recently used first, within ``max_bytes``: each entry charged
    its item's tensor bytes plus `ITEM_ENTRY_BYTES` (the accounting both ends share)."""

    __slots__ = ("_entries", "_max_bytes", "evictions", "nbytes")

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[_V, int]] = OrderedDict()
        self.nbytes = 0
        """Bytes charged for the entries now."""
        self.evictions = 0
        """Entries dropped to make room so far."""

    @property
    def max_bytes(self) -> int:
        """The bound on `nbytes`."""
        return self._max_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _put(self, key: bytes, value: _V, size: int) -> bool:
        """Enter ``value`` for an item of ``size`` tensor bytes, dropping the least recently
        used entries to make room; whether it is in now (an entry there already is only marked
        used; an item larger than the bound is not entered)."""
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            return True
        size += ITEM_ENTRY_BYTES
        if size > self._max_bytes:
            return False
        while self.nbytes + size > self._max_bytes:
            _, (_, dropped) = entries.popitem(last=False)
            self.nbytes -= dropped
            self.evictions += 1
        entries[key] = (value, size)
        self.nbytes += size
        return True

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self.nbytes = 0


class ItemCache(_ByteBoundedLRU[WireItem]):
    """The receiver's items, by key: an LRU bounded by the bytes of their tensors (each item
    also charged `ITEM_ENTRY_BYTES`). An item larger than the whole bound, or smaller than
    `MIN_ITEM_BYTES`, is not kept.

    It keeps each item's `WireFeature` as first received; its tensors are read-only views over
    the frames they came in, which stay alive while it is kept. Belongs to the receiver's
    thread."""

    __slots__ = ()

    def __init__(self, max_bytes: int) -> None:
        super().__init__(check_cache_bytes("ItemCache", max_bytes))

    def get(self, key: bytes) -> WireItem | None:
        """The item kept under ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def keep(self, key: bytes, feature: WireItem, size: int | None = None) -> bool:
        """Keep ``feature`` under ``key`` (the caller computed it with `item_key`; ``size`` is
        `item_nbytes` if known), evicting the least recently used items to make room; whether
        it is kept now. An item kept already is only marked used."""
        if size is None:
            size = item_nbytes(feature)
        return size >= MIN_ITEM_BYTES and self._put(key, feature, size)


class HeldItems(_ByteBoundedLRU[None]):
    """The sender's guess of what a receiver holds: keys the receiver said it held, least
    recently used first, within the bytes the receiver is assumed to keep (the same accounting
    as `ItemCache`). Belongs to the sender, under its lock."""

    __slots__ = ()

    def choose(self, keys: Sequence[bytes | None]) -> list[bytes | None]:
        """For each item of a request (its key, or None for one too small to key): the key when
        the item may go by reference (the receiver said it held it, or it goes in full earlier
        in the same request), else None. Items chosen become the most recently used, as they
        will at the receiver."""
        entries = self._entries
        chosen: list[bytes | None] = []
        earlier: set[bytes] = set()
        for key in keys:
            if key is None:
                chosen.append(None)
                continue
            if key in entries:
                entries.move_to_end(key)
                chosen.append(key)
            elif key in earlier:
                chosen.append(key)  # the receiver finds it in the same message
            else:
                chosen.append(None)
            earlier.add(key)
        return chosen

    def mark(self, key: bytes, size: int) -> None:
        """The receiver said it holds ``key`` (an item of ``size`` tensor bytes)."""
        self._put(key, None, size)

    def forget(self, keys: Iterable[bytes | None]) -> None:
        """The receiver lacked (some of) ``keys``: assume it holds none of them."""
        for key in keys:
            if key is not None:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self.nbytes -= entry[1]
