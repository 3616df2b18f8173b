"""Device-side normalisation on the engine's side: apply a :class:`~mmproc.norm_spec.NormSpec`.

:class:`FusedInputNorm` rescales and normalises uint8 pixels in one affine op per channel on the
engine's device; :func:`to_uint8_pixels` checks that raw pixels are whole numbers in [0, 255] and
makes them uint8; :func:`raw_pixel_kwargs` are the HF processor switches that leave pixels raw.
"""

from __future__ import annotations

import numpy as np
import torch

from mmproc.errors import ConfigurationError
from mmproc.norm_spec import NormSpec

__all__ = ["FusedInputNorm", "raw_pixel_kwargs", "to_uint8_pixels"]


class FusedInputNorm(torch.nn.Module):
    """Rescale and normalise pixels in one affine op: ``y = x * weight + bias``.

    ``weight = rescale / std`` and ``bias = -mean / std`` are computed in float64, rounded once to
    float32 and laid out along the spec's channel axis at construction (buffers, not parameters:
    they are not trained and stay out of state dicts). :meth:`forward` takes uint8 or float input
    of any batch size, on the module's device, computes in float32 and returns ``dtype``.

    On the CPU the product and the sum are rounded separately; on an accelerator they run as one
    ``addcmul`` kernel, which may fuse them into one rounding. Either way every value is within
    3e-7 of the exact ``(x * rescale - mean) / std`` for CLIP's constants, and within 5e-7 of
    transformers' own float32 results (both backends).
    """

    weight: torch.Tensor
    bias: torch.Tensor

    def __init__(
        self,
        spec: NormSpec,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ConfigurationError(f"FusedInputNorm dtype must be a float dtype, got {dtype}")
        self.spec = spec
        self.dtype = dtype
        self._identity = spec.is_identity  # read on every call: computed once
        layout = spec.layout
        weight, bias = spec.weight_and_bias()
        # (C,) -> (tiles, C, block) -> flat along the axis, then trailing 1s so it broadcasts
        # over every dimension after the channel axis.
        shape = (layout.axis_length(spec.num_channels),) + (1,) * (-layout.axis - 1)

        def expand(values: tuple[float, ...]) -> torch.Tensor:
            t = torch.tensor(values, dtype=torch.float64).view(1, -1, 1)
            t = t.expand(layout.tiles, -1, layout.block).reshape(shape)
            return t.to(device=device, dtype=torch.float32)

        self.register_buffer("weight", expand(weight), persistent=False)
        self.register_buffer("bias", expand(bias), persistent=False)

    def extra_repr(self) -> str:
        """Shown by ``repr(module)``."""
        s = self.spec
        return (
            f"mean={s.mean}, std={s.std}, rescale={s.rescale}, layout={s.layout}, "
            f"pixel_keys={s.pixel_keys}, dtype={self.dtype}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (uint8 or float, channel axis as the spec's layout says)."""
        if x.dtype != torch.uint8 and not x.dtype.is_floating_point:
            raise ConfigurationError(f"FusedInputNorm takes uint8 or float input, got {x.dtype}")
        try:
            self.spec.check_shape(x.shape)
        except ConfigurationError as exc:
            raise ConfigurationError(f"FusedInputNorm: {exc}") from None
        if self._identity:
            return x.to(self.dtype)
        if x.device.type != "cpu":
            # One kernel on accelerators: the elementwise kernel reads x in its own dtype,
            # computes in float32 (the buffers' dtype) and casts on the store, so no float32
            # copy of x is ever materialised.
            out = torch.empty(x.shape, dtype=self.dtype, device=x.device)
            return torch.addcmul(self.bias, x, self.weight, out=out)
        # On the CPU that mixed-dtype call allocates float32 temporaries anyway; in-place steps
        # on one float32 copy are faster there.
        if x.dtype == torch.float32:
            y = x * self.weight  # a new tensor: the caller's input is never written to
        else:
            y = x.to(torch.float32)
            y.mul_(self.weight)
        y.add_(self.bias)
        return y if self.dtype == torch.float32 else y.to(self.dtype)


def to_uint8_pixels(pixels: torch.Tensor | np.ndarray) -> torch.Tensor | None:
    """``pixels`` as a uint8 tensor when every value is a whole number in [0, 255], else None.

    A uint8 tensor comes back as it is. NaN, infinities, fractions and values out of range give
    None, so a processor that did not leave its pixels raw is caught rather than shipped wrong.
    The check is exact: a value passes only if casting it to uint8 and back gives it again (any
    value outside [0, 255], NaN included, casts to some byte that cannot cast back to it).
    """
    if isinstance(pixels, np.ndarray):
        pixels = torch.from_numpy(np.ascontiguousarray(pixels))
    t = pixels.detach()
    if t.dtype == torch.uint8:
        return pixels
    if t.dtype == torch.bool or t.is_complex():
        return None
    if t.device.type == "cpu" and t.dtype != torch.bfloat16:  # numpy has no bfloat16
        return _to_uint8_numpy(t)
    as_uint8 = t.to(torch.uint8)
    return as_uint8 if torch.equal(as_uint8.to(t.dtype), t) else None


# Elements per step of the CPU check: the round-trip buffer stays in cache. Whole-tensor torch ops
# were 3-6x slower here (a float32 and a bool temporary the size of the pixels).
_CHECK_CHUNK = 1 << 16


def _to_uint8_numpy(t: torch.Tensor) -> torch.Tensor | None:
    src = t.contiguous().numpy().reshape(-1)
    out = np.empty(src.size, dtype=np.uint8)
    back = np.empty(min(_CHECK_CHUNK, src.size), dtype=src.dtype)
    # out-of-range and NaN casts are what the check is for: silence numpy's warning about them
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, src.size, _CHECK_CHUNK):
            chunk = src[start : start + _CHECK_CHUNK]
            as_uint8 = out[start : start + _CHECK_CHUNK]
            np.copyto(as_uint8, chunk, casting="unsafe")
            round_trip = back[: chunk.size]
            np.copyto(round_trip, as_uint8)
            if not np.array_equal(round_trip, chunk):
                return None
    return torch.from_numpy(out).view(t.shape)


def raw_pixel_kwargs() -> dict[str, bool]:
    """The HF processor kwargs that leave pixels raw: no rescale, no normalise."""
    return {"do_rescale": False, "do_normalize": False}
