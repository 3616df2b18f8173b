"""A processor's device normalisation: which requests get raw uint8 pixels, and keeping it honest.

With a plugin's :class:`~mmproc.norm_spec.NormSpec` and ``device_normalize`` on, a request's
pixels come out of the HF processor raw (rescale and normalise off), are checked to be whole
numbers in [0, 255] and travel as uint8; each feature then carries the spec the engine applies.
A plugin whose pixels are not raw after all (a processor that ignores the switches) turns device
normalisation off for the processor, with a warning: its pixels are normalised on the CPU from
then on, never shipped wrong.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mmproc.context import ModelContext
from mmproc.errors import ConfigurationError

if TYPE_CHECKING:
    from mmproc.model_hooks import ModelHooks
    from mmproc.norm_spec import NormSpec

__all__ = ["RAW_PIXEL_KEYS", "DeviceNormalization"]

logger = logging.getLogger(__name__)

RAW_PIXEL_KEYS = frozenset({"do_rescale", "do_normalize"})
"""``hf_kwargs`` a caller may pass that decide themselves whether pixels come out raw."""


class DeviceNormalization:
    """The device normalisation of one processor (thread-safe).

    Build it with :meth:`for_model`. ``spec`` is the plugin's spec, kept after a fallback switched
    device normalisation off (it still describes raw pixels cached before the switch).
    """

    def __init__(self, spec: NormSpec | None, ctx: ModelContext) -> None:
        self.spec = spec
        self._ctx = ctx
        self._active = spec is not None
        self._lock = threading.Lock()

    @classmethod
    def for_model(
        cls, model: ModelHooks, ctx: ModelContext, processor: Any, requested: bool | None
    ) -> DeviceNormalization:
        """The model's spec unless ``requested`` is False; ``True`` insists on one."""
        if requested is False:
            return cls(None, ctx)
        spec = model.device_norm_spec(ctx, processor)
        if spec is None and requested:
            raise ConfigurationError(
                f"device_normalize=True, but plugin {ctx.plugin!r} gives no device "
                f"normalisation for {ctx.architecture}"
            )
        return cls(spec, ctx)

    @property
    def active(self) -> bool:
        """Whether new requests get raw pixels."""
        return self._active

    @property
    def active_spec(self) -> NormSpec | None:
        """The spec new requests get, or None when pixels are normalised on the CPU."""
        return self.spec if self._active else None

    def raw_pixels_for(self, user_kwargs: Mapping[str, Any]) -> bool:
        """Whether a request's pixels come out raw: device normalisation is on and the caller's
        ``hf_kwargs`` do not set rescale or normalise themselves."""
        return self._active and not (set(user_kwargs) & RAW_PIXEL_KEYS)

    def to_uint8(self, per_item: Mapping[str, list[dict[str, Any]]]) -> bool:
        """Turn raw pixel outputs into uint8 in place; False (and device normalisation switched
        off, with a warning) when some are not whole numbers in [0, 255]."""
        from mmproc.fused_norm import to_uint8_pixels

        assert self.spec is not None, "raw pixels were asked for without a spec"
        for modality, entries in per_item.items():
            for index, entry in enumerate(entries):
                for key in self.spec.pixel_keys:
                    if key not in entry:
                        continue
                    raw = to_uint8_pixels(entry[key])
                    if raw is None:
                        self._switch_off(modality, index, key)
                        return False
                    entry[key] = raw
        return True

    def norm_of(self, data: Mapping[str, Any]) -> NormSpec | None:
        """The spec the engine must apply to an item: set when its pixels are raw (uint8)."""
        spec = self.spec
        if spec is None:
            return None
        raw = any(
            str(getattr(data[key], "dtype", "")).endswith("uint8")
            for key in spec.pixel_keys
            if key in data
        )
        return spec if raw else None

    def _switch_off(self, modality: str, index: int, key: str) -> None:
        with self._lock:
            if not self._active:
                return
            self._active = False
        logger.warning(
            "%s (plugin %r): with rescale and normalise off, %r of %s item %d is not raw "
            "pixels (whole numbers in [0, 255]); device normalisation is now off for this "
            "processor and pixels are normalised on the CPU (float path)",
            self._ctx.architecture,
            self._ctx.plugin,
            key,
            modality,
            index,
        )
