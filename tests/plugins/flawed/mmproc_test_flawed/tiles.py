"""A LLaVA-NeXT-style model: each image is cut into tiles of its best grid, plus a base tile.

The folder's processor is transformers' ``LlavaNextProcessor``, with tiles of 56 pixels: it pads
each image's tiles to the batch's largest count (``pixel_values (N, max_tiles, 3, 56, 56)``) and
returns no tile count, only ``image_sizes``. :class:`Tiles` cuts each image to its own count,
computed from its size (``PaddedField(lengths=...)``); :class:`TilesBatched` does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmproc.plugin import (
    BatchedField,
    FieldSpec,
    PaddedField,
    PromptReplacement,
    PromptUpdate,
    build_tokenizer,
    hookimpl,
    write_model_folder,
)

TILE = 56
PINPOINTS = [[56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]


def tile_counts(outputs: Mapping[str, Any]) -> list[int]:
    """Each image's tiles: one base tile and those of its best grid (as the processor cuts)."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = outputs["pixel_values"].shape[-2:]
    counts = []
    for size in outputs["image_sizes"].tolist():
        best_height, best_width = select_best_resolution(size, PINPOINTS)
        counts.append(1 + (best_height // height) * (best_width // width))
    return counts


class Tiles:
    """Hooks of TilesForTest."""

    @hookimpl
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """One ``<image>`` per image."""
        return "<image>" * mm_counts.get("image", 0)

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """Tiles padded along dim 1, cut to each image's own count."""
        return {
            "pixel_values": PaddedField("image", lengths=tile_counts, dim=1),
            "image_sizes": BatchedField("image"),
        }

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """Each ``<image>`` becomes as many as the processor gives an image of its size."""
        token_id = int(processor.image_token_id)
        images = item_outputs.get("image", [])

        def expand(index: int) -> list[int]:
            height, width = images[index]["image_sizes"].tolist()
            tile_height, tile_width = images[index]["pixel_values"].shape[-2:]
            # transformers' own count for the image (the "default" strategy drops a CLS feature)
            count = processor._get_number_of_features(height, width, tile_height, tile_width)
            return [token_id] * (count - 1)

        return [PromptReplacement("image", [token_id], expand)]


class TilesBatched(Tiles):
    """The flaw: every row of the padded batch kept whole, padding tiles and all."""

    @hookimpl
    def get_mm_fields(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]:
        """One row of padded tiles per image."""
        return {"pixel_values": BatchedField("image"), "image_sizes": BatchedField("image")}


def _write(folder: Path, architecture: str) -> Path:
    tokenizer = build_tokenizer(
        ["<unk>", "<s>", "</s>", "<image>", "<pad>"],
        named_tokens={"bos_token": "<s>", "eos_token": "</s>", "image_token": "<image>"},
    )
    preprocessor = {
        "image_processor_type": "LlavaNextImageProcessor",
        "processor_class": "LlavaNextProcessor",
        "size": {"shortest_edge": TILE},
        "crop_size": {"height": TILE, "width": TILE},
        "resample": 3,
        "do_center_crop": True,
        "do_pad": True,
        "image_grid_pinpoints": PINPOINTS,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    return write_model_folder(
        folder,
        architecture=architecture,
        model_type="llava_next",
        tokenizer=tokenizer,
        preprocessor_config=preprocessor,
        processor_config={
            "processor_class": "LlavaNextProcessor",
            "image_token": "<image>",
            "patch_size": 14,
            "num_additional_image_tokens": 1,
            "vision_feature_select_strategy": "default",
        },
        extra_config={
            "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
            "image_grid_pinpoints": PINPOINTS,
            "vision_config": {"model_type": "clip_vision_model", "image_size": TILE},
            "text_config": {"model_type": "llama", "vocab_size": len(tokenizer)},
        },
    )


def write_tiles_folder(folder: Path) -> Path:
    """The tiles demo model."""
    return _write(folder, "TilesForTest")


def write_tiles_batched_folder(folder: Path) -> Path:
    """The tiles_batched demo model."""
    return _write(folder, "TilesBatchedForTest")
