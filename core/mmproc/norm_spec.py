"""What device-side normalisation needs to know: the numbers and the layout, without torch.

The CPU skips the HF processor's rescale and normalise steps, so the pixel patches stay whole
numbers in [0, 255] and travel as uint8 (a quarter of float32's bytes). The engine then applies one
affine op per channel, ``y = x * w + b`` with ``w = rescale / std`` and ``b = -mean / std``. A
:class:`NormSpec` says which numbers and which tensor layout (:class:`ChannelLayout`); plugins
build it (``device_norm_spec``), the wire carries it, and :class:`mmproc.fused_norm.FusedInputNorm`
applies it on the engine's device. This module imports neither torch nor transformers.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from mmproc.errors import ConfigurationError, DecodeError

__all__ = [
    "MAX_AXIS_LENGTH",
    "MAX_CHANNELS",
    "MAX_NDIM",
    "MAX_PIXEL_KEYS",
    "ChannelLayout",
    "NormSpec",
]

# A spec can arrive from an untrusted message and decides the size of the buffers the engine
# builds (on its device): every size in it is bounded here, so that a spec alone can never ask
# for more than a few MiB, whatever pixels come with it.

MAX_CHANNELS: Final = 64
"""Most channels a `NormSpec` may have values for (``mean`` and ``std`` entries)."""

MAX_AXIS_LENGTH: Final = 1 << 20
"""Longest channel axis a `ChannelLayout` may describe (``tiles * channels * block`` values): a
`FusedInputNorm`'s two float32 buffers then take at most 8 MiB."""

MAX_NDIM: Final = 32
"""Deepest channel axis, counted from the end (``layout.axis >= -MAX_NDIM``); the wire's default
`mmproc.wire.DecodeLimits.max_ndim` too."""

MAX_PIXEL_KEYS: Final = 16
"""Most output names a `NormSpec` may list in ``pixel_keys``."""

_MAX_KEY_LENGTH: Final = 256

# Weights and biases are stored as float32: a value beyond its range would become an infinity.
_FLOAT32_MAX: Final = float(np.finfo(np.float32).max)


def _int_field(name: str, value: Any) -> int:
    # bool is an int subclass; True as an axis or a size is a bug, not a value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int, got {_brief(value)}")
    return value


def _float_field(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(f"{name} must be a number, got {_brief(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigurationError(f"{name} must be finite, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ChannelLayout:
    """Where the channel axis of a pixel tensor is and how each channel's values repeat along it.

    Axis ``axis`` (negative: counted from the end, so leading batch dimensions do not matter) has
    length ``tiles * C * block``: ``tiles`` repetitions of ``C`` channel blocks, each block holding
    ``block`` consecutive values of one channel. Every dimension after ``axis`` belongs to the same
    channel value. ``axis`` lies in ``[-MAX_NDIM, -1]``; ``block * tiles`` (and so the axis length
    with the spec's channels) is at most `MAX_AXIS_LENGTH`. Examples:

    - ``(N, C, H, W)``: ``ChannelLayout.channels_first()``, i.e. ``axis=-3``.
    - ``(N, H, W, C)``: ``ChannelLayout.channels_last()``, i.e. ``axis=-1``.
    - Qwen2-VL ``pixel_values`` ``(num_patches, C*T*P*P)``, each row C blocks of ``T*P*P`` values:
      ``ChannelLayout.flat_patches(patch_size=14, temporal_patch_size=2)``, i.e. ``axis=-1,
      block=392``.
    - Flattened channel-innermost patches ``(num_patches, P*P*C)``: ``axis=-1, tiles=P*P``.
    """

    axis: int
    block: int = 1
    tiles: int = 1

    def __post_init__(self) -> None:
        axis = _int_field("layout.axis", self.axis)
        if axis >= 0:
            raise ConfigurationError(
                f"layout.axis must be negative (counted from the last dimension), got {axis}"
            )
        if axis < -MAX_NDIM:
            raise ConfigurationError(f"layout.axis must be >= {-MAX_NDIM}, got {axis}")
        for name, value in (("layout.block", self.block), ("layout.tiles", self.tiles)):
            if _int_field(name, value) < 1:
                raise ConfigurationError(f"{name} must be >= 1, got {value}")
            if value > MAX_AXIS_LENGTH:
                raise ConfigurationError(f"{name} must be <= {MAX_AXIS_LENGTH}, got {value}")
        if self.block * self.tiles > MAX_AXIS_LENGTH:
            raise ConfigurationError(
                f"layout.block * layout.tiles must be <= {MAX_AXIS_LENGTH}, got "
                f"{self.block} * {self.tiles}"
            )

    @classmethod
    def channels_first(cls) -> ChannelLayout:
        """``(..., C, H, W)`` images or video frames."""
        return cls(axis=-3)

    @classmethod
    def channels_last(cls) -> ChannelLayout:
        """``(..., H, W, C)`` images."""
        return cls(axis=-1)

    @classmethod
    def flat_patches(cls, patch_size: int, temporal_patch_size: int = 1) -> ChannelLayout:
        """``(num_patches, C * T * P * P)`` patch vectors, channel outermost (Qwen2-VL and kin)."""
        t = _int_field("temporal_patch_size", temporal_patch_size)
        p = _int_field("patch_size", patch_size)
        return cls(axis=-1, block=t * p * p)

    def axis_length(self, num_channels: int) -> int:
        """The length the channel axis must have for ``num_channels`` channels."""
        return self.tiles * num_channels * self.block


@dataclass(frozen=True, slots=True)
class NormSpec:
    """What the engine must apply to uint8 pixels to get the model's inputs.

    ``y = (x * rescale - mean[c]) / std[c]`` for every value ``x`` of channel ``c``, where the
    channels sit along the tensor as ``layout`` says, in the outputs named by ``pixel_keys``.
    Sequences given for ``mean``, ``std`` and ``pixel_keys`` are stored as tuples, so a spec is
    hashable (the engine caches one module per spec and device).

    Every value is checked on construction (`ConfigurationError`; `from_wire` makes it a
    ``DecodeError``): at most `MAX_CHANNELS` channels, a channel axis of at most
    `MAX_AXIS_LENGTH` values, weights and biases finite in float32, at most `MAX_PIXEL_KEYS`
    output names. A spec is therefore cheap to build a module for; whether it fits a tensor is
    `check_shape`'s question.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float
    layout: ChannelLayout
    pixel_keys: tuple[str, ...] = ("pixel_values",)

    def __post_init__(self) -> None:
        mean = self._channel_values("mean", self.mean)
        std = self._channel_values("std", self.std)
        if len(mean) != len(std):
            raise ConfigurationError(
                f"mean and std must have one value per channel each, got {len(mean)} and {len(std)}"
            )
        if any(s <= 0 for s in std):
            raise ConfigurationError(f"std must be > 0 for every channel, got {std}")
        rescale = _float_field("rescale", self.rescale)
        if rescale <= 0:
            raise ConfigurationError(f"rescale must be > 0, got {rescale}")
        for index, (m, s) in enumerate(zip(mean, std, strict=True)):
            if rescale / s > _FLOAT32_MAX or abs(m) / s > _FLOAT32_MAX:
                raise ConfigurationError(
                    f"channel {index}: rescale / std and mean / std must fit float32, got "
                    f"rescale={rescale}, mean={m}, std={s}"
                )
        layout = self.layout
        if not isinstance(layout, ChannelLayout):
            raise ConfigurationError(f"layout must be a ChannelLayout, got {_brief(layout)}")
        if layout.axis_length(len(mean)) > MAX_AXIS_LENGTH:
            raise ConfigurationError(
                f"layout.tiles * channels * layout.block must be <= {MAX_AXIS_LENGTH}, got "
                f"{layout.tiles} * {len(mean)} * {layout.block}"
            )
        keys = self.pixel_keys
        if isinstance(keys, str) or not isinstance(keys, Sequence) or not keys:
            raise ConfigurationError(
                f"pixel_keys must be a non-empty list of names, got {_brief(keys)}"
            )
        if len(keys) > MAX_PIXEL_KEYS:
            raise ConfigurationError(
                f"pixel_keys must name at most {MAX_PIXEL_KEYS} outputs, got {len(keys)}"
            )
        if not all(isinstance(k, str) and 0 < len(k) <= _MAX_KEY_LENGTH for k in keys) or len(
            set(keys)
        ) != len(keys):
            raise ConfigurationError(
                f"pixel_keys must be distinct names of 1 to {_MAX_KEY_LENGTH} characters, "
                f"got {_brief(keys)}"
            )
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        object.__setattr__(self, "rescale", rescale)
        object.__setattr__(self, "pixel_keys", tuple(keys))

    @staticmethod
    def _channel_values(name: str, values: Any) -> tuple[float, ...]:
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise ConfigurationError(
                f"{name} must be a non-empty list of numbers, got {_brief(values)}"
            )
        if len(values) > MAX_CHANNELS:
            raise ConfigurationError(
                f"{name} must have at most {MAX_CHANNELS} values (one per channel), "
                f"got {len(values)}"
            )
        return tuple(_float_field(f"{name}[{i}]", v) for i, v in enumerate(values))

    @property
    def num_channels(self) -> int:
        """How many channels the spec has values for."""
        return len(self.mean)

    @property
    def is_identity(self) -> bool:
        """True when applying the spec changes no value (only the dtype)."""
        return (
            self.rescale == 1.0
            and all(m == 0.0 for m in self.mean)
            and all(s == 1.0 for s in self.std)
        )

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raise `ConfigurationError` unless a tensor of ``shape`` has the channel axis the layout
        describes (``layout.axis`` exists and has ``tiles * channels * block`` values)."""
        axis = self.layout.axis
        expected = self.layout.axis_length(self.num_channels)
        if len(shape) < -axis or shape[axis] != expected:
            raise ConfigurationError(
                f"{self.layout} with {self.num_channels} channels expects dimension {axis} of "
                f"length {expected}, got shape {tuple(shape)}"
            )

    def weight_and_bias(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-channel ``rescale / std`` and ``-mean / std``, in float64."""
        weight = tuple(self.rescale / s for s in self.std)
        bias = tuple(-m / s for m, s in zip(self.mean, self.std, strict=True))
        return weight, bias

    def to_wire(self) -> dict[str, Any]:
        """The spec as plain values (dicts, lists, floats, ints, strings) for the wire."""
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "rescale": self.rescale,
            "layout": {
                "axis": self.layout.axis,
                "block": self.layout.block,
                "tiles": self.layout.tiles,
            },
            "pixel_keys": list(self.pixel_keys),
        }

    @classmethod
    def from_wire(cls, data: Any) -> NormSpec:
        """Rebuild a spec from :meth:`to_wire`'s dict; anything malformed raises ``DecodeError``."""
        fields = _wire_mapping(
            "norm spec",
            data,
            required={"mean", "std", "rescale", "layout"},
            optional={"pixel_keys"},
        )
        layout = _wire_mapping(
            "norm spec field 'layout'",
            fields["layout"],
            required={"axis"},
            optional={"block", "tiles"},
        )
        try:
            kwargs: dict[str, Any] = {}
            if "pixel_keys" in fields:
                kwargs["pixel_keys"] = _wire_sequence("pixel_keys", fields["pixel_keys"])
            return cls(
                mean=_wire_sequence("mean", fields["mean"]),
                std=_wire_sequence("std", fields["std"]),
                rescale=fields["rescale"],
                layout=ChannelLayout(**layout),
                **kwargs,
            )
        except ConfigurationError as exc:
            raise DecodeError(f"norm spec: {exc}") from None

    @classmethod
    def from_image_processor(
        cls,
        image_processor: Any,
        *,
        layout: ChannelLayout,
        pixel_keys: Sequence[str] = ("pixel_values",),
        num_channels: int = 3,
    ) -> NormSpec:
        """The spec that reproduces an HF image processor's rescale and normalise steps.

        Reads ``do_rescale``, ``rescale_factor``, ``do_normalize``, ``image_mean`` and
        ``image_std``; a step the processor has switched off becomes the identity. A full HF
        processor is accepted too (its ``image_processor`` is used). A scalar mean or std is
        repeated ``num_channels`` times.
        """
        ip = image_processor
        if not hasattr(ip, "do_normalize") and hasattr(ip, "image_processor"):
            ip = ip.image_processor
        name = type(ip).__name__

        def attribute(attr: str) -> Any:
            value = getattr(ip, attr, None)
            if value is None:
                raise ConfigurationError(f"{name} has no {attr}; cannot build a NormSpec from it")
            return value

        rescale = float(attribute("rescale_factor")) if attribute("do_rescale") else 1.0
        if attribute("do_normalize"):
            mean = _per_channel(attribute("image_mean"), num_channels)
            std = _per_channel(attribute("image_std"), num_channels)
        else:
            n = num_channels
            mean, std = (0.0,) * n, (1.0,) * n
        return cls(mean=mean, std=std, rescale=rescale, layout=layout, pixel_keys=tuple(pixel_keys))


# Error messages may quote values from an untrusted message: reprlib bounds the work and the
# length, whatever the value's size.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 48
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6
_REPR.maxlevel = 2


def _brief(value: Any) -> str:
    return _REPR.repr(value)


def _per_channel(value: Any, num_channels: int) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and tensors
        value = value.tolist()
    if isinstance(value, numbers.Real):
        return (value,) * num_channels
    return tuple(value) if isinstance(value, Sequence) else value


def _wire_mapping(what: str, data: Any, *, required: set[str], optional: set[str]) -> dict:
    if not isinstance(data, Mapping):
        raise DecodeError(f"{what} must be a map, got {type(data).__name__}")
    keys = set(data)
    if missing := required - keys:
        raise DecodeError(f"{what} is missing field(s) {sorted(missing)}")
    if unknown := keys - required - optional:
        shown = sorted(str(key)[:48] for key in list(unknown)[:8])
        raise DecodeError(f"{what} has unknown field(s) {shown}")
    return dict(data)


def _wire_sequence(name: str, value: Any) -> tuple:
    # the wire carries lists; a string is a Sequence too, and must not pass as one
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise DecodeError(f"norm spec field {name!r} must be a list, got {type(value).__name__}")
    return tuple(value)
