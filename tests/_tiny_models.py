"""In-process test models the core's tests build on (``tests`` is on pytest's ``pythonpath``).

``TinyQwenImageModel`` is a Qwen2-VL image model as a plugin author would write it on the core's
default hooks: each test module subclasses it and overrides the hook it is about.
"""

from __future__ import annotations

from typing import Any

from mmproc import hookimpl
from mmproc.fields import BatchedField, FlatField
from mmproc.prompt_update import PromptReplacement

__all__ = ["IMAGE", "PAD", "TinyQwenImageModel"]

PAD = "<|image_pad|>"
IMAGE = f"<|vision_start|>{PAD}<|vision_end|>"


class TinyQwenImageModel:
    """Qwen2-VL's image placeholder, fields and prompt updates; everything else the core's."""

    @hookimpl
    def get_dummy_text(self, mm_counts: Any) -> str:
        return IMAGE * mm_counts.get("image", 0)

    @hookimpl
    def get_mm_fields(self, outputs: Any) -> Any:
        return {
            "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
            "image_grid_thw": BatchedField("image"),
        }

    @hookimpl
    def get_prompt_updates(self, processor: Any, item_outputs: Any) -> Any:
        pad = processor.image_token_id
        images = item_outputs.get("image", [])

        def expand(index: int) -> list[int]:
            return [pad] * (int(images[index]["image_grid_thw"].prod()) // 4)

        return [PromptReplacement("image", [pad], expand)]
