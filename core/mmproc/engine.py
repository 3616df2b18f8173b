"""The receiving side: turn a decoded feature's tensors into model inputs on the engine's device.

Pixel tensors that travelled as uint8 are moved to the device as uint8 (a quarter of float32's
bytes over PCIe) and normalised there by a cached :class:`~mmproc.fused_norm.FusedInputNorm`;
pixel tensors that travelled as floats (the CPU path) are cast to the model dtype; everything else
is moved as it is. This module knows nothing of the wire's classes: a feature is a dict of tensors
and its norm spec the plain dict of :meth:`NormSpec.to_wire`.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Any

import torch

from mmproc.errors import ConfigurationError, DecodeError
from mmproc.fused_norm import FusedInputNorm, NormSpec

__all__ = ["DEFAULT_PIXEL_KEYS", "norm_module", "prepare_feature", "prepare_request"]

#: Outputs treated as pixels when a feature carries no norm spec (they are cast to the model dtype).
DEFAULT_PIXEL_KEYS: tuple[str, ...] = ("pixel_values", "pixel_values_videos")


@functools.lru_cache(maxsize=64)
def _cached_norm_module(spec: NormSpec, device: torch.device, dtype: torch.dtype) -> FusedInputNorm:
    return FusedInputNorm(spec, dtype=dtype, device=device).eval()


def norm_module(
    spec: NormSpec,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
) -> FusedInputNorm:
    """The :class:`FusedInputNorm` for ``spec`` on ``device``, built once and then reused.

    Equal specs share a module (specs are compared by value), so decoding a spec per request costs
    no new buffers on the device. Engines that batch several features before normalising can call
    this and apply the module to the concatenated pixels themselves.
    """
    return _cached_norm_module(spec, _resolve(torch.device(device)), dtype)


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

    - With a spec, each pixel tensor must be uint8: it is moved as uint8, then normalised with the
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
    module = norm_module(spec, device=device, dtype=dtype) if spec is not None else None

    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
        elif key not in pixel_keys:
            out[key] = _move(value, device)
        elif module is not None:
            if value.dtype != torch.uint8:
                raise DecodeError(
                    f"feature field {key!r} has a norm spec but dtype {value.dtype}; "
                    "device-normalised pixels must arrive as uint8"
                )
            try:
                out[key] = module(_move(value, device))
            except ConfigurationError as exc:
                raise DecodeError(f"feature field {key!r}: {exc}") from None
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
