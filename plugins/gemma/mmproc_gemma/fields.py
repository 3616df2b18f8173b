"""A field for outputs the plugin already gives per item: Gemma 3's crops, Gemma's audio frames.

transformers' Gemma processors drop what would say how their batched outputs split per item:
Gemma 3 concatenates each image with its pan-and-scan crops and drops ``num_crops``; the audio
feature extractors pad every clip to the batch's longest and give no length. ``process_mm_data``
knows each item (its size, its samples), so it hands these outputs on as one value per item, and
:class:`PerItemField` takes them as they are; they join back as the HF processor batches them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmproc.plugin import FieldSpec, FieldSpecError, FlatField, PaddedField

__all__ = ["PerItemField", "concatenated", "padded"]


@dataclass(frozen=True)
class PerItemField(FieldSpec):
    """An output given as a list with one value per item; ``like`` says how the values join
    into the HF processor's batched value (concatenated, or padded to the longest)."""

    modality: str
    like: FieldSpec

    def split(self, key: str, value: Any, count: int, outputs: Mapping[str, Any]) -> list[Any]:
        """The items' values, as ``process_mm_data`` gave them."""
        if not isinstance(value, list | tuple) or len(value) != count:
            got = (
                f"{len(value)} values" if isinstance(value, list | tuple) else type(value).__name__
            )
            raise FieldSpecError(
                f"{key!r} (per item, {self.modality}): expected a list of {count} per-item values "
                f"from the gemma plugin's process_mm_data, got {got}"
            )
        return list(value)

    def join(self, key: str, values: Sequence[Any]) -> Any:
        """The batched value, as ``like`` joins it."""
        return self.like.join(key, values)


def concatenated(modality: str) -> PerItemField:
    """Values joined along dim 0 (each image with its crops: ``(1 + crops, 3, H, W)``)."""
    return PerItemField(modality, FlatField(modality, sizes=()))


def padded(modality: str) -> PerItemField:
    """Values padded along their first dim to the longest, then stacked (audio frames: features
    ``(frames, 128)`` with zeros, masks ``(frames,)`` with False)."""
    return PerItemField(modality, PaddedField(modality, lengths=(), dim=1))
