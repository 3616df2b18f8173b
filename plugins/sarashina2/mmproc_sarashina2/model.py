"""The Sarashina2-Vision model hooks.

Images become Qwen2-VL patches (``pixel_values``, rows ``3 * temporal_patch_size * patch_size**2``)
plus a ``(t, h, w)`` grid per image; in a prompt each image is ``<|prefix|><|file|><|suffix|>``
(the model's chat format puts it after ``<s>``, before the ``### Human:`` / ``### Assistant:``
turns), and ``<|file|>`` expands to ``prod(grid) / merge_size**2`` copies of itself.

The image processing is Qwen2-VL's, so the hooks are the qwen_vl plugin's, native uint8 paths
included (:mod:`mmproc_qwen_vl.image_fast_path`, :mod:`mmproc_qwen_vl.torch_fast_path`), but for
loading (:mod:`mmproc_sarashina2.loading`: the folder's own settings, the model's ``_preprocess``
contract), the prompt markers, and images only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmproc import hookimpl
from mmproc.context import ModelContext
from mmproc.media import MediaFormat
from mmproc_qwen_vl.model import QwenVLModel

from mmproc_sarashina2.loading import IMAGE_MARKERS, load_sarashina2_processor

__all__ = ["IMAGE_PLACEHOLDER", "Sarashina2VisionModel"]

IMAGE_PLACEHOLDER = "".join(IMAGE_MARKERS.values())  # <|prefix|><|file|><|suffix|>


class Sarashina2VisionModel(QwenVLModel):
    """Hooks for ``Sarashina2VisionForCausalLM`` (the qwen_vl plugin's, for what they share)."""

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Assembled from the folder's files (see :mod:`mmproc_sarashina2.loading`)."""
        return load_sarashina2_processor(ctx)

    @hookimpl
    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """One ``<|prefix|><|file|><|suffix|>`` per image; the model takes no video."""
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    @hookimpl
    def media_format(self, processor: Any) -> MediaFormat | None:
        """Images only: nothing to say about video or audio."""
        return None
