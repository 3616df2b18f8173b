"""The receiving side: turn a decoded feature's tensors into model inputs on the engine's device.

Pixel tensors that travelled as uint8 are moved to the device as uint8 (a quarter of float32's
bytes over PCIe) and normalised there by a cached :class:`~mmproc.fused_norm.FusedInputNorm`;
pixel tensors that travelled as floats (the CPU path) are cast to the model dtype; everything else
is moved as it is. This module knows nothing of the wire's classes: a feature is a dict of tensors
and its norm spec the plain dict of :meth:`NormSpec.to_wire`.

A norm spec comes from the message, so nothing is built from it before it has been checked: its
own bounds when it is decoded (:class:`NormSpec`), then its fit with the pixel tensor it describes.
Only then is a module built (or found) in the cache, which is keyed by the checked spec and
bounded in bytes (:data:`NORM_CACHE_BYTES`), not only in entries.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any, Final, NamedTuple

import torch

from mmproc.errors import ConfigurationError, DecodeError
from mmproc.fused_norm import FusedInputNorm
from mmproc.norm_spec import NormSpec

__all__ = [
    "DEFAULT_PIXEL_KEYS",
    "NORM_CACHE_BYTES",
    "NORM_CACHE_ENTRIES",
    "NormCacheInfo",
    "norm_cache_info",
    "norm_module",
    "prepare_feature",
    "prepare_request",
]

#: Outputs treated as pixels when a feature carries no norm spec (they are cast to the model dtype).
DEFAULT_PIXEL_KEYS: tuple[str, ...] = ("pixel_values", "pixel_values_videos")

NORM_CACHE_BYTES: Final = 32 << 20
"""Most bytes of buffers (on every device together) the cached norm modules may hold: least
recently used modules are dropped beyond it. A spec's buffers take at most 8 MiB
(:data:`mmproc.norm_spec.MAX_AXIS_LENGTH`); a real model's, a few KiB."""

NORM_CACHE_ENTRIES: Final = 64
"""Most norm modules cached, whatever their size."""


class NormCacheInfo(NamedTuple):
    """What the norm-module cache holds now (:func:`norm_cache_info`)."""

    entries: int
    """Modules cached."""
    nbytes: int
    """Bytes of their buffers (weights and biases, on their devices)."""


_CacheKey = tuple[NormSpec, torch.device, torch.dtype]


class _ModuleCache:
    """An LRU cache of norm modules bounded in bytes and in entries; safe across threads."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._modules: OrderedDict[_CacheKey, tuple[FusedInputNorm, int]] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def get(self, key: _CacheKey) -> FusedInputNorm:
        with self._lock:
            hit = self._modules.get(key)
            if hit is not None:
                self._modules.move_to_end(key)
                return hit[0]
        spec, device, dtype = key
        # Built outside the lock: two threads may build the same module, and one is dropped.
        module = FusedInputNorm(spec, dtype=dtype, device=device).eval()
        size = module.weight.nbytes + module.bias.nbytes
        with self._lock:
            hit = self._modules.get(key)
            if hit is not None:
                return hit[0]
            if size > self._max_bytes:
                return module  # larger than the whole cache: used once, never kept
            self._modules[key] = (module, size)
            self._nbytes += size
            while self._nbytes > self._max_bytes or len(self._modules) > self._max_entries:
                _, (_, dropped) = self._modules.popitem(last=False)
                self._nbytes -= dropped
        return module

    def info(self) -> NormCacheInfo:
        with self._lock:
            return NormCacheInfo(len(self._modules), self._nbytes)


_MODULES = _ModuleCache(NORM_CACHE_BYTES, NORM_CACHE_ENTRIES)


def norm_module(
    spec: NormSpec,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
) -> FusedInputNorm:
    """The :class:`FusedInputNorm` for ``spec`` on ``device``, built once and then reused.

    Equal specs share a module (specs are compared by value), so decoding a spec per request costs
    no new buffers on the device. Engines that batch several features before normalising can call
    this and apply the module to the concatenated pixels themselves (check them first with
    :meth:`NormSpec.check_shape`). The cache keeps the most recently used modules, within
    :data:`NORM_CACHE_BYTES` and :data:`NORM_CACHE_ENTRIES`.
    """
    if not isinstance(spec, NormSpec):
        raise TypeError(f"norm_module takes a NormSpec, got {type(spec).__name__}")
    return _MODULES.get((spec, _resolve(torch.device(device)), dtype))


def norm_cache_info() -> NormCacheInfo:
    """How many norm modules are cached and how many bytes their buffers take."""
    return _MODULES.info()


def _resolve(device: torch.device) -> torch.device:
    # "cuda" means the current device when it is used: pin the index, so a module cached under
    # it keeps matching the tensors moved to it after the current device changes
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _move(
    tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    # an asynchronous host-to-device copy needs pinned memory; from pageable memory the copy is
    # synchronous whatever is asked, so ask only where it helps
    non_blocking = device.type != "cpu" and tensor.device.type == "cpu" and tensor.is_pinned()
    return tensor.to(device=device, dtype=dtype, non_blocking=non_blocking)


def prepare_feature(
    data: Mapping[str, Any],
    norm: Mapping[str, Any] | NormSpec | None,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    pixel_keys: Collection[str] | None = None,
) -> dict[str, Any]:
    """Move one feature's tensors to ``device`` and make its pixels model inputs of ``dtype``.

    ``norm`` is the feature's norm spec (the dict from :meth:`NormSpec.to_wire`, or a spec), or
    None when the pixels were normalised on the CPU. ``pixel_keys`` names the pixel outputs; by
    default the spec's ``pixel_keys``, or :data:`DEFAULT_PIXEL_KEYS` without a spec. A named key
    the feature lacks is skipped (an image feature has no video pixels).

    - With a spec, each pixel tensor must be uint8 and have the channel axis the spec describes
      (both checked before any module is built): it is moved as uint8, then normalised with the
      cached module for (spec, device, dtype). A float tensor next to a spec is refused, since it
      cannot tell raw from already-normalised values.
    - Without a spec, float pixel tensors are cast to ``dtype`` (on the device); uint8 pixels
      are refused (they would reach the model unnormalised).
    - Every other tensor is moved as it is (dtype kept); values that are not tensors pass through.

    A malformed spec, or pixels that do not fit it, raise :class:`~mmproc.errors.DecodeError`
    naming the key.
    """
    device = _resolve(torch.device(device))
    spec = norm if isinstance(norm, NormSpec) or norm is None else NormSpec.from_wire(norm)
    if pixel_keys is None:
        pixel_keys = spec.pixel_keys if spec is not None else DEFAULT_PIXEL_KEYS

    out: dict[str, Any] = {}
    module: FusedInputNorm | None = None
    for key, value in data.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
        elif key not in pixel_keys:
            out[key] = _move(value, device)
        elif spec is not None:
            if value.dtype != torch.uint8:
                raise DecodeError(
                    f"feature field {key!r} has a norm spec but dtype {value.dtype}; "
                    "device-normalised pixels must arrive as uint8"
                )
            # The spec must fit these pixels before a module is built (or cached) from it.
            try:
                spec.check_shape(value.shape)
            except ConfigurationError as exc:
                raise DecodeError(f"feature field {key!r}: norm spec: {exc}") from None
            if module is None:
                module = norm_module(spec, device=device, dtype=dtype)
            out[key] = module(_move(value, device))
        elif value.is_floating_point():
            out[key] = _move(value, device, dtype)
        elif value.dtype == torch.uint8:
            # Raw pixels with nothing to say how to normalise them would reach the model as
            # 0..255: refuse rather than feed it silently wrong inputs.
            raise DecodeError(
                f"feature field {key!r} holds uint8 pixels but the feature has no norm spec"
            )
        else:
            out[key] = _move(value, device)
    return out


def prepare_request(
    request: Any,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict[str, Any]]:
    """Model inputs of every feature of a received :class:`mmproc.wire.EngineRequest`, in order.

    Each entry is :func:`prepare_feature` of that feature: tensors on ``device``, pixels
    normalised (uint8 ones by their norm spec) and cast to ``dtype``. Errors name the feature.
    """
    prepared = []
    for position, feature in enumerate(request.features):
        try:
            prepared.append(prepare_feature(feature.data, feature.norm, device=device, dtype=dtype))
        except DecodeError as exc:
            raise DecodeError(
                f"request {request.request_id!r}, feature {position} "
                f"({feature.modality} item {feature.item_index}): {exc}"
            ) from None
    return prepared
