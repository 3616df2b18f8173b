"""A fixed-size image model (LLaVA-1.5's recipe, 112-pixel crops) with two flaws.

:class:`Deaf` runs the HF processor with the core's keyword arguments only, dropping the
caller's per-request ``hf_kwargs`` (a smaller ``crop_size`` changes nothing). :class:`Blank`
gets every prompt right but returns blank pixels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmproc.plugin import (
    BatchedField,
    FieldSpec,
    ProcessingMode,
    PromptReplacement,
    PromptUpdate,
    build_tokenizer,
    hookimpl,
    write_model_folder,
)

CROP = 112


class _Fixed:
    @hookimpl
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """One ``<image>`` per image."""
        return "<image>" * mm_counts.get("image", 0)

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """One ``(3, H, W)`` image per row."""
        return {"pixel_values": BatchedField("image")}

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """Each ``<image>`` becomes one token per 14-pixel patch of the crop."""
        token_id = int(processor.image_token_id)
        images = item_outputs.get("image", [])

        def expand(index: int) -> list[int]:
            height, width = images[index]["pixel_values"].shape[-2:]
            return [token_id] * ((int(height) // 14) * (int(width) // 14))

        return [PromptReplacement("image", [token_id], expand)]


class Deaf(_Fixed):
    """The flaw: the caller's hf_kwargs never reach the HF processor."""

    @hookimpl
    def process_mm_data(
        self,
        mode: ProcessingMode,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Any:
        """The HF processor with the core's kwargs alone."""
        core_only = {k: v for k, v in hf_kwargs.items() if k not in mode.user_kwargs}
        images = list(mm_items.get("image", ()))
        return processor(text=[prompt], images=images, return_tensors="pt", **core_only)


class Blank(_Fixed):
    """The flaw: blank pixels."""

    @hookimpl
    def process_mm_data(
        self,
        prompt: str,
        mm_items: Mapping[str, Sequence[Any]],
        processor: Any,
        hf_kwargs: Mapping[str, Any],
    ) -> Any:
        """The HF processor's outputs with every pixel zero."""
        images = list(mm_items.get("image", ()))
        outputs = processor(text=[prompt], images=images, return_tensors="pt", **hf_kwargs)
        outputs["pixel_values"] = outputs["pixel_values"] * 0
        return outputs


def _write(folder: Path, architecture: str) -> Path:
    tokenizer = build_tokenizer(
        ["<unk>", "<s>", "</s>", "<image>", "<pad>"],
        named_tokens={"bos_token": "<s>", "eos_token": "</s>", "image_token": "<image>"},
    )
    return write_model_folder(
        folder,
        architecture=architecture,
        model_type="llava",
        tokenizer=tokenizer,
        preprocessor_config={
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "size": {"shortest_edge": CROP},
            "crop_size": {"height": CROP, "width": CROP},
            "resample": 3,
            "do_center_crop": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
        processor_config={
            "processor_class": "LlavaProcessor",
            "image_token": "<image>",
            "patch_size": 14,
            "num_additional_image_tokens": 0,
            "vision_feature_select_strategy": "full",
        },
        extra_config={
            "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
            "vision_feature_select_strategy": "full",
            "vision_config": {"model_type": "clip_vision_model", "image_size": CROP},
            "text_config": {"model_type": "llama", "vocab_size": len(tokenizer)},
        },
    )


def write_deaf_folder(folder: Path) -> Path:
    """The fixed_deaf demo model."""
    return _write(folder, "FixedDeafForTest")


def write_blank_folder(folder: Path) -> Path:
    """The fixed_blank demo model."""
    return _write(folder, "FixedBlankForTest")
