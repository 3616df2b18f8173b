"""Build InternVL3's processor (transformers' form) from a local model folder, either backend.

transformers' ``InternVLProcessor`` returns every image tile and every video frame of a call in
one ``pixel_values``, in prompt order, and drops the per-image tile counts, so its outputs
cannot be cut back into items. :class:`InternVLItemsProcessor` is that processor with the merge
left out: the same kwargs merging, tiling, frames and prompt expansion (all transformers' own
code), returning ``pixel_values`` (image tiles) with ``num_patches`` (tiles per image) and
``pixel_values_videos`` (frames per video) apart. Concatenating an InternVL request's items'
pixels in prompt order gives transformers' ``pixel_values``; the plugin's identity tests check
exactly that against ``InternVLProcessor`` called directly.

The image processor comes from the ``backend`` option: ``GotOcr2ImageProcessor`` (torchvision,
the default) or ``GotOcr2ImageProcessorPil``. ``AutoProcessor`` cannot give the PIL backend (the
video processor has none), so the parts are loaded one by one.
"""

from __future__ import annotations

from typing import Any

from mmproc.plugin import ModelContext
from mmproc_qwen_vl.shared import chosen_backend
from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.processing_internvl import InternVLProcessor
from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor
from transformers.processing_utils import ProcessorMixin

__all__ = ["InternVLItemsProcessor", "image_processor_class", "load_internvl_processor"]


class InternVLItemsProcessor(InternVLProcessor):
    """transformers' ``InternVLProcessor``, returning images and videos under their own keys.

    ``pixel_values`` (all images' tiles) and ``num_patches`` (one count per image) for images,
    ``pixel_values_videos`` ``(videos, frames, 3, H, W)`` for videos; ``input_ids`` expanded as
    transformers expands them. It also runs on media alone, without text (the tokens of a
    media-only call are never used), which ``InternVLProcessor`` refuses.
    """

    def validate_inputs(  # type: ignore[override]
        self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any
    ) -> None:
        """transformers' checks of the inputs, less InternVL's "text is required"."""
        ProcessorMixin.validate_inputs(self, images=images, text=text, videos=videos, **kwargs)

    def __call__(
        self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any
    ) -> Any:
        """``InternVLProcessor.__call__`` without its last step, the merge of the pixels."""
        # The same two-step merging InternVLProcessor does: its own defaults (crop_to_patches
        # on) win over the folder's image processor settings, as there.
        merged = self._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs, **kwargs)
        text = [text] if isinstance(text, str) else text
        return ProcessorMixin.__call__(self, images=images, text=text, videos=videos, **merged)


def image_processor_class(backend: str) -> type[Any]:
    """InternVL's image processor class for ``backend`` (``"pil"`` or ``"torchvision"``)."""
    return GotOcr2ImageProcessorPil if backend == "pil" else GotOcr2ImageProcessor


def load_internvl_processor(ctx: ModelContext) -> InternVLItemsProcessor:
    """The processor for ``ctx``'s folder, with the image backend of option ``backend``."""
    backend = chosen_backend(ctx)
    folder = str(ctx.require_model_path())
    extra = dict(ctx.processor_options.hf_processor_kwargs)
    image_processor = image_processor_class(backend).from_pretrained(
        folder, local_files_only=True, **extra
    )
    video_processor = InternVLVideoProcessor.from_pretrained(folder, local_files_only=True, **extra)
    return InternVLItemsProcessor.from_pretrained(
        folder,
        local_files_only=True,
        image_processor=image_processor,
        video_processor=video_processor,
    )
