"""The PaddleOCR-VL model hooks.

Images become patches ``(num_patches, C*T, P, P)`` (temporal patch 1) plus a ``(t, h, w)`` grid
per image; each ``<|IMAGE_PLACEHOLDER|>`` expands to ``prod(grid) / merge_size**2`` copies of
itself, between ``<|IMAGE_START|>`` and ``<|IMAGE_END|>``: Qwen2-VL's expansion, so the prompt
updates and the backend option are :mod:`mmproc_qwen_vl.shared`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mmproc.plugin import (
    BatchedField,
    ChannelLayout,
    FieldSpec,
    FlatField,
    ModelContext,
    NormSpec,
    PromptUpdate,
    hookimpl,
    read_chat_template,
)
from mmproc_qwen_vl.shared import chosen_backend, grid_prompt_updates

__all__ = ["PaddleOCRVLModel"]

IMAGE_PLACEHOLDER = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"


class PaddleOCRVLModel:
    """Hooks for ``PaddleOCRVLForConditionalGeneration``."""

    @hookimpl
    def extra_options(self, ctx: ModelContext) -> tuple[str, ...]:
        """``backend``: ``"pil"`` or ``"torchvision"`` (default) image processor."""
        return ("backend",)

    @hookimpl
    def load_hf_processor(self, ctx: ModelContext) -> Any:
        """Image processor of the chosen backend, the tokenizer and the chat template."""
        backend = chosen_backend(ctx)
        folder = ctx.require_model_path()
        from transformers import AutoTokenizer
        from transformers.models.paddleocr_vl.processing_paddleocr_vl import PaddleOCRVLProcessor

        ImageProcessor: type[Any]
        if backend == "pil":
            from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
                PaddleOCRVLImageProcessorPil as ImageProcessor,
            )
        else:
            from transformers.models.paddleocr_vl.image_processing_paddleocr_vl import (
                PaddleOCRVLImageProcessor as ImageProcessor,
            )
        extra = dict(ctx.processor_options.hf_processor_kwargs)
        return PaddleOCRVLProcessor(
            image_processor=ImageProcessor.from_pretrained(
                str(folder), local_files_only=True, **extra
            ),
            tokenizer=AutoTokenizer.from_pretrained(str(folder), local_files_only=True),
            chat_template=read_chat_template(folder),
        )

    @hookimpl
    def get_dummy_text(self, ctx: ModelContext, mm_counts: Mapping[str, int]) -> str:
        """One ``<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>`` per image."""
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    @hookimpl
    def get_mm_fields(
        self, ctx: ModelContext, outputs: Mapping[str, Any]
    ) -> Mapping[str, FieldSpec]:
        """Patches split by each image's grid product; grids one row per image."""
        return {
            "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
            "image_grid_thw": BatchedField("image"),
        }

    @hookimpl
    def get_prompt_updates(
        self, processor: Any, item_outputs: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> Sequence[PromptUpdate]:
        """Each ``<|IMAGE_PLACEHOLDER|>`` becomes ``prod(grid) / merge_size**2`` of itself, as
        Qwen2-VL's pad does."""
        return grid_prompt_updates(processor, item_outputs)

    @hookimpl
    def device_norm_spec(self, ctx: ModelContext, processor: Any) -> NormSpec | None:
        """Patches are ``(N, C*T, P, P)``, channel-outermost: the channel axis is -3."""
        image_processor = processor.image_processor
        layout = ChannelLayout(axis=-3, block=int(image_processor.temporal_patch_size))
        return NormSpec.from_image_processor(image_processor, layout=layout)
