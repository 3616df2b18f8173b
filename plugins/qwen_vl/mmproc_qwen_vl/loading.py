"""Build a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 processor from a local model folder, either
image backend.

The processor is assembled from its parts instead of through ``AutoProcessor`` because two real
folder layouts break the Auto classes: ``AutoProcessor.from_pretrained(folder, backend="pil")``
fails (the video processor has no PIL backend), and Qwen2.5-VL hub folders name an image
processor class transformers does not have (``Qwen2_5_VLImageProcessor``). The image processor
class of the chosen backend reads the same settings from both the hub layout
(``preprocessor_config.json`` with ``min_pixels`` / ``max_pixels``) and the ``save_pretrained``
layout (``processor_config.json``).

Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE share one processor, ``Qwen3VLProcessor``, with
Qwen2-VL's image processor and ``Qwen3VLVideoProcessor``; the tokenizer comes from
``AutoTokenizer``, which loads Qwen3.5 folders as ``Qwen3_5Tokenizer`` whatever class they name.
The processor takes frames given without metadata as the plugin does
(:func:`mmproc_qwen_vl.timestamps.keep_given_frames`).
"""

from __future__ import annotations

from typing import Any

from mmproc.plugin import ModelContext, read_chat_template

from mmproc_qwen_vl.plugin import QWEN3_ARCHITECTURES
from mmproc_qwen_vl.shared import chosen_backend, qwen2_vl_image_processor_class
from mmproc_qwen_vl.timestamps import keep_given_frames

__all__ = ["load_qwen_processor"]

_QWEN2_5_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


def load_qwen_processor(ctx: ModelContext) -> Any:
    """The HF processor for ``ctx``'s folder, with the image backend of option ``backend``."""
    backend = chosen_backend(ctx)
    folder = ctx.require_model_path()
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    ImageProcessor = qwen2_vl_image_processor_class(backend)
    VideoProcessor: type[Any] = Qwen2VLVideoProcessor
    ProcessorClass: type[Any]
    if ctx.architecture in QWEN3_ARCHITECTURES:
        from transformers.models.qwen3_vl.processing_qwen3_vl import (
            Qwen3VLProcessor as ProcessorClass,
        )
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor as VideoProcessor,
        )
    elif ctx.architecture == _QWEN2_5_ARCHITECTURE:
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import (
            Qwen2_5_VLProcessor as ProcessorClass,
        )
    else:
        from transformers.models.qwen2_vl.processing_qwen2_vl import (
            Qwen2VLProcessor as ProcessorClass,
        )
    extra = dict(ctx.processor_options.hf_processor_kwargs)
    image_processor = ImageProcessor.from_pretrained(str(folder), local_files_only=True, **extra)
    video_processor = VideoProcessor.from_pretrained(str(folder), local_files_only=True, **extra)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    processor = ProcessorClass(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=read_chat_template(folder),
    )
    if ctx.architecture in QWEN3_ARCHITECTURES:
        keep_given_frames(processor)
    return processor
