"""The engine request schema: what the front end sends and the engine receives.

An `EngineRequest` is a request id, the prompt token ids (placeholders already expanded), one
`WireFeature` per media item, free-form engine parameters, and the model's per-token outputs of
the prompt (``prompt_outputs``, e.g. ``mm_token_type_ids``: one 1-D tensor per name, as long as
the prompt). On the wire it is a msgpack map (see
`EngineRequest.to_wire`) encoded by `mmproc.wire.codec`, so every tensor in it leaves as its own
frame once it is at least the zero-copy threshold.

The map, in this key order (tensors as the codec's ``[dtype, shape, data]``)::

    {"schema_version": 4,
     "request_id": str,
     "prompt_token_ids": ["<i8", [n], data],
     "features": [{"modality": str, "item_index": int, "hash": str,
                   "offset": int, "length": int, "is_embed": bool tensor | None,
                   "data": {str: tensor, ...} | None, "norm": {str: plain value} | None,
                   "ref": bin (16 bytes) | None}, ...],
     "params": {str: any codec value},
     "prompt_outputs": {str: tensor of shape [n], ...}}

A feature travels in full (``data`` and ``norm`` set, ``ref`` None) or by reference (``data``
and ``norm`` None, ``ref`` the item's key, `mmproc.wire.items.item_key`): then the receiver fills
in the tensors and norm spec of the item it keeps under that key, and the feature's own fields
(modality, index, hash, placement, ``is_embed``) stay the request's. `decode_request` resolves
references against the ``items`` it is given and raises `mmproc.wire.items.MissingItemsError`
(a `DecodeError`) for one it cannot; a decoded request never holds a reference.

The prompt's token ids travel as one little-endian int64 array (numpy's ``"<i8"``), not as a
msgpack array of ints: packing, parsing and checking one int at a time costs several times more
on each side (``benchmarks/wire.py``), and a long prompt's ids leave as a zero-copy frame.

It carries ``schema_version``; a receiver rejects any other version than `SCHEMA_VERSION`
with a `DecodeError` that says which versions met, so a front end and an engine from different
releases fail loudly instead of misreading each other.

Both classes validate on construction (``TypeError`` / ``ValueError`` naming the field) and
decoding turns any such failure into a `DecodeError`, so a decoded request is as well-formed as
one built locally. `encode_request` / `decode_request` lay the map out and read it directly
(same bytes as ``encode(request.to_wire())``): fields validated on construction are not walked
again, and decoded token ids are checked as one array.

Both classes are frozen; their lists, dicts and tensors are shared, not copied, and must be
treated as read-only (decoded tensors are views over the received frames).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias, cast

import numpy as np
import torch

from mmproc.errors import DecodeError
from mmproc.wire.codec import (
    DEFAULT_LIMITS,
    DecodeLimits,
    Frame,
    TreeEncoder,
    decode_tree,
    encode_tree,
)
from mmproc.wire.items import (
    ITEM_KEY_BYTES,
    MIN_ITEM_BYTES,
    ItemCache,
    MissingItemsError,
    WireItem,
    item_key,
    item_nbytes,
)
from mmproc.wire.parse import Fault, MemoryBudget, short_repr

__all__ = [
    "SCHEMA_VERSION",
    "EngineRequest",
    "WireFeature",
    "decode_request",
    "encode_request",
]

SCHEMA_VERSION: Final = 4
"""Version of the request layout below; bumped on any incompatible change (2: token ids as an
int64 array; 3: ``prompt_outputs``; 4: features by reference, ``ref``)."""

_FEATURE_KEYS: Final = (
    "modality",
    "item_index",
    "hash",
    "offset",
    "length",
    "is_embed",
    "data",
    "norm",
    "ref",
)
_REQUEST_KEYS: Final = (
    "schema_version",
    "request_id",
    "prompt_token_ids",
    "features",
    "params",
    "prompt_outputs",
)
_KEY_SETS: Final[dict[tuple[str, ...], frozenset[str]]] = {
    keys: frozenset(keys) for keys in (_FEATURE_KEYS, _REQUEST_KEYS)
}
_FEATURE_KEY_SET: Final = _KEY_SETS[_FEATURE_KEYS]
_REQUEST_KEY_SET: Final = _KEY_SETS[_REQUEST_KEYS]

# Token ids are non-negative and fit the int64 the engine stores them in.
_MAX_TOKEN_ID: Final = 2**63 - 1
# Normalisation parameters are flat numbers and short lists (per-channel mean / std, a patch
# layout); nesting beyond this is not a normalisation spec.
_NORM_MAX_DEPTH: Final = 4
_NORM_SCALARS: Final = (str, int, float, bool, type(None))
_NORM_SCALAR_TYPES: Final = frozenset(_NORM_SCALARS)
_NUMBER_TYPES: Final = frozenset({int, float, bool})
_STR_ONLY: Final = frozenset({str})
_INT_ONLY: Final = {int}


# Byte of an unsigned 64-bit array item that holds its top bit.
_TOP_BYTE: Final = 7 if sys.byteorder == "little" else 0


def _token_ids_in_range(ids: list[int]) -> bool:
    """Whether ints (checked by the caller) all lie in [0, 2**63), in two C-level passes.

    ``array("Q")`` takes only ints in [0, 2**64), about twice as fast as ``min`` or ``max`` alone
    run over the list; an item also below 2**63 has the top bit of its top byte clear, which is
    what ``isascii`` checks over those bytes."""
    try:
        unsigned = array("Q", ids)
    except OverflowError:
        return False
    if unsigned.itemsize != 8:  # no known platform; the plain way then
        return min(ids) >= 0 and max(ids) <= _MAX_TOKEN_ID
    return memoryview(unsigned).cast("B")[_TOP_BYTE::8].tobytes().isascii()


# How token ids travel: one little-endian int64 array.
_TOKEN_DTYPE: Final = np.dtype("<i8")


def _token_bytes(ids: list[int]) -> memoryview:
    """The ids as the bytes of a little-endian int64 array (one C-level conversion)."""
    try:
        packed = array("q", ids)
    except (TypeError, OverflowError) as exc:
        # Validated on construction: only a list changed since then to hold a non-int or an int
        # past 64 bits gets here (other changes, a negative id say, are caught by the receiver).
        raise Fault(f"token ids changed after the request was built: {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return memoryview(packed).cast("B")


def _token_array(ids: list[int]) -> np.ndarray:
    """The ids as the int64 array `to_wire` puts in the map (same bytes as `_token_bytes`)."""
    try:
        return np.frombuffer(_token_bytes(ids), dtype=_TOKEN_DTYPE)
    except Fault as fault:
        raise ValueError(f"EngineRequest.prompt_token_ids: {fault.reason}") from None


# What one token id costs as an item of the engine's list: an int object and its slot.
_TOKEN_ID_BYTES: Final = 40
# What one decoded feature costs besides its parsed map and tensors: the WireFeature, its data
# dict and its entry in the request's duplicate check.
_FEATURE_BYTES: Final = 512
# Bounds of both: a feature's map takes at least 67 bytes of body (its eight keys alone take 58),
# a token id 8 bytes of the message (its array may be a frame of its own).
_BUILD_COST: Final = (_FEATURE_BYTES // 64, _TOKEN_ID_BYTES // 8)


def _token_list(
    value: Any, max_tokens: int | None, budget: MemoryBudget | None = None
) -> list[int]:
    """Decoded token ids: a 1-D ``"<i8"`` array of at most ``max_tokens`` ids in [0, 2**63), as
    the list the engine gets, paid for in ``budget`` (if any) first. Checked as one array, never
    int by int, before any int is made."""
    if type(value) is not np.ndarray or value.dtype != _TOKEN_DTYPE or value.ndim != 1:
        if isinstance(value, np.ndarray):
            got = f"{value.dtype.str} array of shape {value.shape}"
        elif isinstance(value, torch.Tensor):
            got = f"{value.dtype} tensor of shape {tuple(value.shape)}"
        else:
            got = type(value).__name__
        raise DecodeError(
            f"engine request prompt_token_ids must be a 1-D '<i8' (int64) array, got {got}"
        )
    if max_tokens is not None and len(value) > max_tokens:
        raise DecodeError(
            f"engine request has {len(value)} prompt token ids, more than the limit of "
            f"{max_tokens} (DecodeLimits.max_prompt_tokens)"
        )
    if value.size and value.min() < 0:
        raise DecodeError("bad engine request: prompt_token_ids must lie in [0, 2**63)")
    if budget is not None:
        try:
            budget.charge(_TOKEN_ID_BYTES * len(value))
        except Fault as fault:
            raise DecodeError(
                f"engine request has {len(value)} prompt token ids: {fault.reason}"
            ) from None
    return value.tolist()


def _index(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0, got {value}")


def _numbers(value: list[Any], depth: int) -> bool:
    for item in value:
        if type(item) is list:
            if depth >= _NORM_MAX_DEPTH or not _numbers(item, depth + 1):
                return False
        elif not isinstance(item, (int, float)):  # bool is an int
            return False
    return True


def _tensor_map(data: dict[Any, Any]) -> bool:
    """Whether every key is a str and every value a plain torch tensor (exact types)."""
    for key, value in data.items():
        if type(key) is not str or type(value) is not torch.Tensor:
            return False
    return True


def _norm_map(norm: dict[Any, Any]) -> bool:
    """Whether every key is a str and every value a normalisation parameter."""
    for key, value in norm.items():
        if type(key) is not str or not _norm_value(value):
            return False
    return True


def _norm_value(value: object, depth: int = 1) -> bool:
    """A normalisation parameter: a scalar, a (nested) list of numbers, a list of strings (names
    of pixel outputs), or a map of those (a layout). No list mixes strings with anything else, so
    none can take the ``[dtype, shape, frame]`` form of an encoded tensor."""
    kind = type(value)
    if kind in _NORM_SCALAR_TYPES or isinstance(value, _NORM_SCALARS):
        return True
    if isinstance(value, list) and kind is list:
        # One C-level pass settles the usual flat lists (per-channel mean / std, output names).
        types = set(map(type, value))
        if types <= _NUMBER_TYPES or types == _STR_ONLY:
            return True
        return all(type(item) is str for item in value) or _numbers(value, depth)
    if type(value) is dict and depth < _NORM_MAX_DEPTH:
        return all(type(k) is str and _norm_value(v, depth + 1) for k, v in value.items())
    return False


@dataclass(frozen=True, slots=True, eq=False)
class WireFeature:
    """One media item of a request, as the engine needs it.

    ``eq=False``: features hold tensors, whose ``==`` is element-wise; compare fields explicitly.
    """

    modality: str
    """``"image"``, ``"video"``, ``"audio"``..."""
    item_index: int
    """Index of the item among the request's items of this modality."""
    hash: str
    """Content hash of the item (framed bytes + model id + processing options)."""
    offset: int
    """First prompt position of the item's placeholder range."""
    length: int
    """Number of prompt positions in the placeholder range."""
    is_embed: torch.Tensor | None
    """Bool tensor of shape ``(length,)``: which placeholder positions take an embedding. None
    means all of them."""
    data: dict[str, torch.Tensor]
    """The item's model inputs, one tensor per processor output key (``pixel_values``,
    ``image_grid_thw``...)."""
    norm: dict[str, Any] | None = None
    """None when the pixels are ready for the model; otherwise the pixels still need device-side
    normalisation, and this is the parameter dict (``NormSpec.to_wire()``) to apply: str keys,
    values str / int / float / bool / None or (nested) lists of numbers."""

    def __post_init__(self) -> None:
        # The fast path: exact types, as decoding and the processor make them, all checked in
        # one expression. Anything else, wrong or merely unusual (subclasses), takes the full
        # checks below, which say what is wrong.
        length = self.length
        is_embed = self.is_embed
        norm = self.norm
        if (
            type(self.modality) is str
            and self.modality
            and type(self.hash) is str
            and _exact_placement(self.item_index, self.offset, length, is_embed)
            and type(self.data) is dict
            and _tensor_map(self.data)
            and (norm is None or (type(norm) is dict and _norm_map(norm)))
        ):
            return
        self._check()

    def _check(self) -> None:
        owner = "WireFeature"
        if not isinstance(self.modality, str):
            raise TypeError(f"{owner}.modality must be a str, got {type(self.modality).__name__}")
        if not self.modality:
            raise ValueError(f"{owner}.modality must not be empty")
        _index(owner, "item_index", self.item_index)
        if not isinstance(self.hash, str):
            raise TypeError(f"{owner}.hash must be a str, got {type(self.hash).__name__}")
        _index(owner, "offset", self.offset)
        _index(owner, "length", self.length)
        if self.is_embed is not None:
            if not isinstance(self.is_embed, torch.Tensor):
                raise TypeError(
                    f"{owner}.is_embed must be a bool tensor or None, got "
                    f"{type(self.is_embed).__name__}"
                )
            if self.is_embed.dtype is not torch.bool or self.is_embed.shape != (self.length,):
                raise ValueError(
                    f"{owner}.is_embed must be a bool tensor of shape ({self.length},) "
                    f"(the placeholder length), got {self.is_embed.dtype} "
                    f"{tuple(self.is_embed.shape)}"
                )
        if not isinstance(self.data, dict):
            raise TypeError(f"{owner}.data must be a dict, got {type(self.data).__name__}")
        for key, value in self.data.items():
            if not isinstance(key, str):
                raise TypeError(f"{owner}.data keys must be str, got {short_repr(key)}")
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{owner}.data[{short_repr(key)}] must be a torch tensor, got "
                    f"{type(value).__name__}"
                )
        if self.norm is not None:
            if not isinstance(self.norm, dict):
                raise TypeError(
                    f"{owner}.norm must be a dict of plain values or None, got "
                    f"{type(self.norm).__name__}"
                )
            for key, value in self.norm.items():
                if not isinstance(key, str) or not _norm_value(value):
                    raise TypeError(
                        f"{owner}.norm[{short_repr(key)}] must be a str key with a str/int/float/"
                        f"bool/None value, a (nested) list of numbers, a list of strings or a "
                        f"map of those, got {_describe(value)}"
                    )

    @property
    def needs_device_norm(self) -> bool:
        """Whether the engine must still normalise this item's pixels (with `norm`)."""
        return self.norm is not None

    def to_wire(self) -> dict[str, Any]:
        """The map that goes on the wire (tensors still in it; the codec frames them)."""
        return {
            "modality": self.modality,
            "item_index": self.item_index,
            "hash": self.hash,
            "offset": self.offset,
            "length": self.length,
            "is_embed": self.is_embed,
            "data": self.data,
            "norm": self.norm,
            "ref": None,
        }

    def _wire_tree(self, encoder: TreeEncoder, position: int, ref: bytes | None) -> dict[str, Any]:
        """`to_wire`, encoded in place: only the tensors go through the encoder's walk. With
        ``ref`` (the item's key), the feature goes by reference: without tensors or norm."""
        is_embed = self.is_embed
        return {
            "modality": self.modality,
            "item_index": self.item_index,
            "hash": self.hash,
            "offset": self.offset,
            "length": self.length,
            "is_embed": None
            if is_embed is None
            else encoder.value(is_embed, ("features", position, "is_embed")),
            "data": None
            if ref is not None
            else {
                key: encoder.value(value, ("features", position, "data", key))
                for key, value in self.data.items()
            },
            "norm": None if ref is not None else self.norm,  # validated: plain values
            "ref": ref,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> WireFeature:
        """Build a feature from its decoded map; anything malformed is a `DecodeError`, a
        feature by reference a `mmproc.wire.items.MissingItemsError` (only a request is filled
        in: `decode_request`)."""
        feature = _build_feature(obj, 0, _as_is)
        if type(feature) is _Reference:
            raise MissingItemsError(
                f"engine request {feature.describe()} is a reference; decode the request it "
                "came in with the receiver's items",
                [0],
            )
        return cast(WireFeature, feature)  # not a reference


@dataclass(frozen=True, slots=True, eq=False)
class EngineRequest:
    """A processed request, ready for an engine core.

    ``eq=False``: requests hold tensors, whose ``==`` is element-wise; compare fields explicitly.
    """

    request_id: str
    """Unique id of the request (non-empty)."""
    prompt_token_ids: list[int]
    """Prompt token ids with every placeholder expanded; each feature's range lies inside."""
    features: list[WireFeature] = field(default_factory=list)
    """One entry per media item, in prompt order."""
    params: dict[str, Any] = field(default_factory=dict)
    """Free-form engine parameters (sampling settings, priorities...): str keys, values anything
    the codec carries. mmproc does not interpret them."""
    prompt_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The model's per-token outputs of the prompt (its plugin's ``get_prompt_outputs``): name ->
    1-D tensor with one entry per prompt token."""

    def __post_init__(self) -> None:
        owner = "EngineRequest"
        ids = self.prompt_token_ids
        if not isinstance(ids, list):
            raise TypeError(f"{owner}.prompt_token_ids must be a list, got {type(ids).__name__}")
        # C-speed checks: these lists run to 100k+ entries. `type is int` refuses bools.
        if ids:
            if set(map(type, ids)) != _INT_ONLY:
                raise TypeError(f"{owner}.prompt_token_ids must hold only ints")
            if not _token_ids_in_range(ids):
                raise ValueError(f"{owner}.prompt_token_ids must lie in [0, 2**63)")
        self._check_fields(len(ids))

    @classmethod
    def _with_checked_ids(
        cls,
        request_id: Any,
        prompt_token_ids: list[int],
        features: Any,
        params: Any,
        prompt_outputs: Any,
    ) -> EngineRequest:
        """Build a request whose token ids are known good (the decoder checked them as one
        array), checking every other field as the constructor does."""
        request = object.__new__(cls)
        for name, value in (
            ("request_id", request_id),
            ("prompt_token_ids", prompt_token_ids),
            ("features", features),
            ("params", params),
            ("prompt_outputs", prompt_outputs),
        ):
            object.__setattr__(request, name, value)
        request._check_fields(len(prompt_token_ids))
        return request

    def _check_fields(self, prompt_length: int) -> None:
        """Every check but the token ids' own; ``TypeError`` / ``ValueError`` naming the field."""
        owner = "EngineRequest"
        if not isinstance(self.request_id, str):
            raise TypeError(
                f"{owner}.request_id must be a str, got {type(self.request_id).__name__}"
            )
        if not self.request_id:
            raise ValueError(f"{owner}.request_id must not be empty")
        if not isinstance(self.features, list):
            raise TypeError(f"{owner}.features must be a list, got {type(self.features).__name__}")
        seen: set[tuple[str, int]] = set()
        for position, feature in enumerate(self.features):
            if not isinstance(feature, WireFeature):
                raise TypeError(
                    f"{owner}.features[{position}] must be a WireFeature, got "
                    f"{type(feature).__name__}"
                )
            if feature.offset + feature.length > prompt_length:
                raise ValueError(
                    f"{owner}.features[{position}] ({feature.modality} {feature.item_index}) "
                    f"spans prompt positions {feature.offset}..{feature.offset + feature.length}"
                    f" but the prompt has {prompt_length} tokens"
                )
            item = (feature.modality, feature.item_index)
            if item in seen:
                raise ValueError(
                    f"{owner}.features has {feature.modality} item {feature.item_index} twice"
                )
            seen.add(item)
        if not isinstance(self.params, dict):
            raise TypeError(f"{owner}.params must be a dict, got {type(self.params).__name__}")
        for key in self.params:
            if not isinstance(key, str):
                raise TypeError(f"{owner}.params keys must be str, got {short_repr(key)}")
        outputs = self.prompt_outputs
        if not isinstance(outputs, dict):
            raise TypeError(f"{owner}.prompt_outputs must be a dict, got {type(outputs).__name__}")
        for name, value in outputs.items():
            if not isinstance(name, str):
                raise TypeError(f"{owner}.prompt_outputs keys must be str, got {short_repr(name)}")
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{owner}.prompt_outputs[{name!r}] must be a torch.Tensor, got "
                    f"{type(value).__name__}"
                )
            if tuple(value.shape) != (prompt_length,):
                raise ValueError(
                    f"{owner}.prompt_outputs[{name!r}] has shape {tuple(value.shape)}; it must "
                    f"have one entry per prompt token ({prompt_length},)"
                )

    def to_wire(self) -> dict[str, Any]:
        """The map that goes on the wire, ``schema_version`` included."""
        return {
            "schema_version": SCHEMA_VERSION,
            "request_id": self.request_id,
            "prompt_token_ids": _token_array(self.prompt_token_ids),
            "features": [feature.to_wire() for feature in self.features],
            "params": self.params,
            "prompt_outputs": self.prompt_outputs,
        }

    def _wire_tree(
        self, encoder: TreeEncoder, refs: Sequence[bytes | None] | None = None
    ) -> dict[str, Any]:
        """`to_wire`, encoded in place. The fields validated on construction go into the tree as
        they are; params, being free-form, are walked. ``refs`` has, per feature, the key it goes
        by reference under, or None to send it in full."""
        return {
            "schema_version": SCHEMA_VERSION,
            "request_id": self.request_id,
            "prompt_token_ids": self._token_tree(encoder),
            "features": [
                feature._wire_tree(encoder, position, None if refs is None else refs[position])
                for position, feature in enumerate(self.features)
            ],
            "params": encoder.value(self.params, ("params",)),
            "prompt_outputs": encoder.value(self.prompt_outputs, ("prompt_outputs",)),
        }

    def _token_tree(self, encoder: TreeEncoder) -> list[Any]:
        ids = self.prompt_token_ids
        try:
            return encoder.raw(_TOKEN_DTYPE.str, (len(ids),), _token_bytes(ids))
        except Fault as fault:
            fault.path.append("prompt_token_ids")
            raise

    @classmethod
    def from_wire(
        cls, obj: Any, *, limits: DecodeLimits | None = None, items: ItemCache | None = None
    ) -> EngineRequest:
        """Build a request from its decoded map (as `mmproc.wire.decode` returns it), filling
        features sent by reference in from ``items``.

        Raises `DecodeError` for a schema version other than `SCHEMA_VERSION`, a missing or
        unknown key, more token ids than ``limits.max_prompt_tokens`` (default `DEFAULT_LIMITS`),
        or any field that fails validation (naming the feature at fault); its subclass
        `mmproc.wire.items.MissingItemsError` for a reference ``items`` does not hold.
        """
        max_tokens = (DEFAULT_LIMITS if limits is None else limits).max_prompt_tokens
        return _build_request(obj, _as_is, _as_is, max_tokens, None, items)[0]


# How the builders below get a field's final value: as it is (a map `decode` already converted),
# or through the decoder (a raw msgpack tree, converted only where the schema puts tensors).
_Resolve: TypeAlias = Callable[[Any, tuple[str | int, ...]], Any]


def _as_is(value: Any, path: tuple[str | int, ...]) -> Any:
    return value


class _Reference:
    """A feature that came by reference, until its item is filled in (`_fill`)."""

    __slots__ = ("is_embed", "key", "position", "raw")

    def __init__(self, raw: dict[str, Any], position: int, is_embed: Any, key: bytes) -> None:
        self.raw = raw
        self.position = position
        self.is_embed = is_embed
        self.key = key

    def describe(self) -> str:
        raw = self.raw
        return (
            f"feature {self.position} ({short_repr(raw['modality'])} item "
            f"{short_repr(raw['item_index'])}, hash {short_repr(raw['hash'])}, "
            f"key {self.key.hex()})"
        )

    def fill(self, item: WireItem) -> WireFeature:
        """The feature: this reference's own fields, the item's tensors and norm spec."""
        raw = self.raw
        if raw["modality"] != item.modality or raw["hash"] != item.hash:
            # The key covers both: only a peer that names another item's key gets here.
            raise DecodeError(
                f"engine request {self.describe()}: the key names {item.modality} item "
                f"{item.hash!r}, not this one"
            )
        try:
            return _placed(item, raw["item_index"], raw["offset"], raw["length"], self.is_embed)
        except (TypeError, ValueError) as exc:
            raise DecodeError(
                f"engine request feature {self.position}: bad feature: {exc}"
            ) from None


def _exact_placement(item_index: Any, offset: Any, length: Any, is_embed: Any) -> bool:
    """Whether a feature's placement has the exact types and ranges decoding makes: the fast
    path of :class:`WireFeature`'s checks (anything else takes the full checks, which say what
    is wrong)."""
    return (
        type(item_index) is int
        and item_index >= 0
        and type(offset) is int
        and offset >= 0
        and type(length) is int
        and length >= 0
        and (
            is_embed is None
            or (
                type(is_embed) is torch.Tensor
                and is_embed.dtype is torch.bool
                and is_embed.shape == (length,)
            )
        )
    )


def _placed(
    item: WireItem, item_index: Any, offset: Any, length: Any, is_embed: Any
) -> WireFeature:
    """A kept item (tensors and norm spec, checked when it was decoded) at another place in
    another request: only the placement's fields are checked, as the constructor does."""
    if _exact_placement(item_index, offset, length, is_embed):
        feature = object.__new__(WireFeature)
        for name, value in (
            ("modality", item.modality),
            ("item_index", item_index),
            ("hash", item.hash),
            ("offset", offset),
            ("length", length),
            ("is_embed", is_embed),
            ("data", dict(item.data)),  # the request's own dict; the tensors are shared
            ("norm", item.norm),
        ):
            object.__setattr__(feature, name, value)
        return feature
    # Something unusual or wrong: the constructor's checks say what.
    norm = None if item.norm is None else dict(item.norm)
    return WireFeature(
        item.modality, item_index, item.hash, offset, length, is_embed, dict(item.data), norm
    )


def _build_feature(raw: Any, position: int, tensor: _Resolve) -> WireFeature | _Reference:
    if type(raw) is not dict:
        raise DecodeError(
            f"engine request feature {position}: a feature must be a map, got {type(raw).__name__}"
        )
    if raw.keys() != _FEATURE_KEY_SET:  # one C-level set comparison on the good path
        _exact_keys(f"engine request feature {position}: feature", raw, _FEATURE_KEYS)
    is_embed = raw["is_embed"]
    if is_embed is not None:
        is_embed = tensor(is_embed, ("features", position, "is_embed"))
    ref = raw["ref"]
    if ref is not None:
        if type(ref) is not bytes or len(ref) != ITEM_KEY_BYTES:
            raise DecodeError(
                f"engine request feature {position}: ref must be {ITEM_KEY_BYTES} bytes (an item"
                f" key) or nil, got {short_repr(ref)}"
            )
        if raw["data"] is not None or raw["norm"] is not None:
            raise DecodeError(
                f"engine request feature {position}: a feature by reference has nil data and "
                "norm (the receiver fills them in)"
            )
        return _Reference(raw, position, is_embed, ref)
    data = raw["data"]
    if type(data) is dict:
        for key in data:
            if type(key) is not str:
                raise DecodeError(
                    f"engine request feature {position}: data key {short_repr(key)} is not a str"
                )
        data = {
            key: tensor(value, ("features", position, "data", key)) for key, value in data.items()
        }
    try:
        return WireFeature(
            raw["modality"],
            raw["item_index"],
            raw["hash"],
            raw["offset"],
            raw["length"],
            is_embed,
            data,
            raw["norm"],
        )
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"engine request feature {position}: bad feature: {exc}") from None


def _build_request(
    obj: Any,
    tensor: _Resolve,
    value: _Resolve,
    max_tokens: int | None,
    budget: MemoryBudget | None = None,
    items: ItemCache | None = None,
) -> tuple[EngineRequest, list[bytes | None]]:
    """The request, and per feature the key it came by reference under (None: in full)."""
    if type(obj) is not dict:
        raise DecodeError(f"an engine request must be a map, got {type(obj).__name__}")
    version = obj.get("schema_version")
    if version is None:
        raise DecodeError("not an mmproc engine request: the map has no 'schema_version'")
    if type(version) is not int or version != SCHEMA_VERSION:  # type first: arrays compare oddly
        raise DecodeError(
            f"engine request has schema version {short_repr(version)}, but this mmproc reads "
            f"version {SCHEMA_VERSION}; run the same mmproc release on the front end and the engine"
        )
    if obj.keys() != _REQUEST_KEY_SET:
        _exact_keys("engine request", obj, _REQUEST_KEYS)
    raw_features = obj["features"]
    if type(raw_features) is not list:
        raise DecodeError(
            f"engine request features must be a list, got {type(raw_features).__name__}"
        )
    if budget is not None and raw_features:
        try:
            budget.charge(_FEATURE_BYTES * len(raw_features))
        except Fault as fault:
            fault.path.append("features")
            raise
    built = [_build_feature(raw, position, tensor) for position, raw in enumerate(raw_features)]
    keys: list[bytes | None] = [None] * len(built)
    if any(type(feature) is _Reference for feature in built):
        features = _fill(obj["request_id"], built, keys, items)
    else:
        features = cast(list[WireFeature], built)  # no reference among them
    ids = _token_list(tensor(obj["prompt_token_ids"], ("prompt_token_ids",)), max_tokens, budget)
    params = value(obj["params"], ("params",))
    raw_outputs = obj["prompt_outputs"]
    if type(raw_outputs) is not dict:
        raise DecodeError(
            f"engine request prompt_outputs must be a map, got {type(raw_outputs).__name__}"
        )
    for name in raw_outputs:
        if type(name) is not str:
            raise DecodeError(f"engine request prompt_outputs key {short_repr(name)} is not a str")
    outputs = {name: tensor(raw, ("prompt_outputs", name)) for name, raw in raw_outputs.items()}
    try:
        request = EngineRequest._with_checked_ids(obj["request_id"], ids, features, params, outputs)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"bad engine request: {exc}") from None
    return request, keys


def _fill(
    request_id: Any,
    built: list[WireFeature | _Reference],
    keys: list[bytes | None],
    items: ItemCache | None,
) -> list[WireFeature]:
    """Every feature of a request with references, the references filled in (from ``items``,
    or from an item in full earlier in the same request); their keys go into ``keys``. Every
    reference is resolved before anything is stored, so none can be evicted meanwhile."""
    found: dict[int, WireItem] = {}
    local: dict[bytes, WireItem] | None = None
    missing: list[_Reference] = []
    for feature in built:
        if type(feature) is not _Reference:
            continue
        item = None if items is None else items.get(feature.key)
        if item is None:
            if local is None:  # keyed only when some reference is not in the cache
                local = {}
                for other in built:
                    if type(other) is WireFeature and item_nbytes(other) >= MIN_ITEM_BYTES:
                        local.setdefault(item_key(other), other)
            item = local.get(feature.key)
        if item is None:
            missing.append(feature)
        else:
            found[feature.position] = item
        keys[feature.position] = feature.key
    if missing:
        shown = "; ".join(reference.describe() for reference in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise MissingItemsError(
            f"engine request {short_repr(request_id)} refers to items this receiver does not hold: "
            f"{shown}{more} (evicted, never received, or sent to another receiver); send it "
            "again with its items in full",
            [reference.position for reference in missing],
        )
    return [
        feature.fill(found[feature.position]) if isinstance(feature, _Reference) else feature
        for feature in built
    ]


def _describe(value: object) -> str:
    return type(value).__name__ + (" holding a non-number" if type(value) is list else "")


def _exact_keys(what: str, obj: dict[str, Any], expected: tuple[str, ...]) -> None:
    if obj.keys() == _KEY_SETS[expected]:  # one C-level set comparison on the good path
        return
    missing = [key for key in expected if key not in obj]
    # Keys of a raw msgpack map may be bytes as well as str: shown, never sorted or sliced.
    unknown = [short_repr(key) for key in obj if key not in expected][:8]
    parts = []
    if missing:
        parts.append(f"missing {missing}")
    if unknown:
        parts.append(f"unknown [{', '.join(unknown)}]")
    raise DecodeError(f"{what} map has the wrong keys: {'; '.join(parts)}")


def encode_request(
    request: EngineRequest,
    *,
    threshold: int | None = None,
    by_reference: Collection[bytes] = (),
) -> list[Frame]:
    """Encode a request into frames (see `mmproc.wire.encode`): the tensors of its features that
    reach the zero-copy threshold leave as aux frames viewing their memory. A feature whose
    `mmproc.wire.items.item_key` is in ``by_reference`` goes as a reference, without tensors, for
    a receiver that holds the item (`RequestSender` chooses these itself)."""
    if not isinstance(request, EngineRequest):
        raise TypeError(f"encode_request takes an EngineRequest, got {type(request).__name__}")
    refs = None
    if by_reference:
        refs = [
            key if key in by_reference else None
            for key in (item_key(feature) for feature in request.features)
        ]
    return encode_request_refs(request, threshold, refs)


def encode_request_refs(
    request: EngineRequest, threshold: int | None, refs: Sequence[bytes | None] | None
) -> list[Frame]:
    """Internal to `mmproc.wire`: `encode_request` with, per feature, the key it goes by
    reference under (None: in full)."""
    # Same bytes as encode(request.to_wire()), without re-walking what construction validated.
    if refs is None:
        return encode_tree(request._wire_tree, threshold)
    return encode_tree(lambda encoder: request._wire_tree(encoder, refs), threshold)


def decode_request(
    frames: Sequence[Any], *, limits: DecodeLimits | None = None, items: ItemCache | None = None
) -> EngineRequest:
    """Decode frames made by `encode_request` into an `EngineRequest` whose tensors are read-only
    views over the frames. Anything malformed, a schema version mismatch included, raises
    `DecodeError`. Frame 0 must hold a map, which is checked on its first byte before anything is
    parsed; everything built on the way (parsed values, tensor objects, the token id list, the
    features) is charged to the memory budget of ``limits`` first. Custom ``limits`` must allow
    the ``"<i8"`` dtype the token ids travel in (`RequestReceiver` checks that at start-up).

    Features sent by reference are filled in from ``items`` (whose tensors they then share);
    one it does not hold raises `mmproc.wire.items.MissingItemsError`. Nothing is stored in
    ``items`` here (`RequestReceiver` keeps the items of the requests it hands out)."""
    return decode_request_keys(frames, limits, items)[0]


def decode_request_keys(
    frames: Sequence[Any], limits: DecodeLimits | None, items: ItemCache | None
) -> tuple[EngineRequest, list[bytes | None]]:
    """Internal to `mmproc.wire`: `decode_request`, and per feature the key it came by
    reference under (None: in full, or not keyed)."""
    # Read the raw tree once, converting only where the schema holds tensors and params.
    return decode_tree(
        frames,
        limits,
        lambda tree, decoder: _build_request(
            tree,
            decoder.tensor,
            decoder.value,
            decoder.limits.max_prompt_tokens,
            decoder.budget,
            items,
        ),
        root_map="an engine request",
        build_cost=_BUILD_COST,
    )
