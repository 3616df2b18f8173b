"""The Sarashina2-Vision model hooks.

Images become Qwen2-VL patches (``pixel_values``, rows ``3 * temporal_patch_size * patch_size**2``)
plus a ``(t, h, w)`` grid per image; in a prompt each image is ``<|prefix|><|file|><|suffix|>``
(the model's chat format puts it after ``<s>``, before the ``### Human:`` / ``### Assistant:``
turns), and ``<|file|>`` expands to ``prod(grid) / merge_size**2`` copies of itself.

The image processing is Qwen2-VL's, so the hooks build on :mod:`mmproc_qwen_vl.shared` (native
uint8 paths included); what is Sarashina2's own is the loading (:mod:`mmproc_sarashina2.loading`:
the folder's own settings, the model's ``_preprocess`` contract), the prompt markers, and images
only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mmproc.plugin import FieldSpec, ModelContext, NormSpec, ProcessingMode, PromptUpdate, hookimpl
from mmproc_qwen_vl.shared import grid_prompt_updates, patch_fields, patch_norm_spec, uint8_patches

from mmproc_sarashina2.loading import IMAGE_MARKERS, load_sarashina2_processor

__all__ = ["IMAGE_PLACEHOLDER", "Sarashina2VisionModel"]

IMAGE_PLACEHOLDER = "".join(IMAGE_MARKERS.values())  # <|prefix|><|file|><|suffix|>


class Sarashina2VisionModel:
    """Hooks for ``Sarashina2VisionForCausalLM``."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: ``"pil"`` or ``"torchvision"`` (default) image processor."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Assembled from the folder's files (see :mod:`mmproc_sarashina2.loading`)."""
        return load_sarashina2_processor(ctx)

    @hookimpl
    def process_mm_data(
        self, mode: ProcessingMode, mm_items: Mapping[str, Sequence[Any]], processor: Any
    ) -> Mapping[str, Any] | None:
        """Qwen2-VL's native uint8 paths; None lets the HF processor run."""
        return uint8_patches(mode, mm_items.get("image", ()), processor)

    @hookimpl
    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """One ``<|prefix|><|file|><|suffix|>`` per image; the model takes no video."""
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    @hookimpl
    def get_mm_fields(
        self, ctx: ModelContext, outputs: Mapping[str, Any]
    ) -> Mapping[str, FieldSpec]:
        """Patches are flat, split by each image's grid product; grids are one row per image."""
        return patch_fields(outputs, modalities=("image",))

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """Each ``<|file|>`` becomes ``prod(grid) / merge_size**2`` copies of itself."""
        return grid_prompt_updates(processor, item_outputs)

    @hookimpl
    def device_norm_spec(self, processor: Any) -> NormSpec | None:
        """Pixels travel as uint8; the engine normalises with the image processor's settings."""
        return patch_norm_spec(processor)
