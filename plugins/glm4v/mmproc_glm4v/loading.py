"""Build a GLM-4.xV processor from a local model folder, on either image backend.

Two processors ship with these models: transformers' ``Glm4vProcessor`` (GLM-4.1V, GLM-4.5V)
writes each frame pair's timestamp as whole seconds, ``Glm46VProcessor`` (GLM-4.6V) as
``x.y seconds``; and one architecture ships with either (GLM-4.6V is a
``Glm4vMoeForConditionalGeneration``). So the folder's ``processor_class`` decides, as it does
for transformers' ``AutoProcessor``; a folder naming none gets its model type's. The image
processor comes from the ``backend`` option; the video processor has a torchvision backend
only, which is why the parts are loaded one by one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mmproc.plugin import ModelContext, ProcessorLoadError, read_json_object
from mmproc_qwen_vl.shared import chosen_backend
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.models.glm46v.image_processing_glm46v import Glm46VImageProcessor
from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil
from transformers.models.glm46v.processing_glm46v import Glm46VProcessor
from transformers.models.glm46v.video_processing_glm46v import Glm46VVideoProcessor

__all__ = ["PROCESSORS", "ProcessorParts", "load_glm_processor", "processor_class_name"]


class ProcessorParts(NamedTuple):
    """One of the GLM-4.xV processors, its image processor per backend, its video processor."""

    processor: type[Any]
    torchvision: type[Any]
    pil: type[Any]
    video: type[Any]


PROCESSORS: dict[str, ProcessorParts] = {
    "Glm4vProcessor": ProcessorParts(
        Glm4vProcessor, Glm4vImageProcessor, Glm4vImageProcessorPil, Glm4vVideoProcessor
    ),
    "Glm46VProcessor": ProcessorParts(
        Glm46VProcessor, Glm46VImageProcessor, Glm46VImageProcessorPil, Glm46VVideoProcessor
    ),
}
"""``processor_class`` -> the processor and its parts."""

# The processor of a folder that names none, by model type (transformers' AutoProcessor's).
_BY_MODEL_TYPE = {
    "glm4v": "Glm4vProcessor",
    "glm4v_moe": "Glm4vProcessor",
    "glm46v": "Glm46VProcessor",
}


def processor_class_name(ctx: ModelContext) -> str:
    """The processor class the folder names (``processor_config.json``, else
    ``preprocessor_config.json``), or its model type's."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        settings = read_json_object(ctx, name, required=False) or {}
        if settings.get("processor_class"):
            named = str(settings["processor_class"])
            break
    else:
        named = _BY_MODEL_TYPE.get(str(ctx.config.get("model_type")), "Glm4vProcessor")
    if named not in PROCESSORS:
        raise ProcessorLoadError(
            f"{ctx.architecture} (plugin {ctx.plugin!r}): the folder names processor class "
            f"{named!r}; this plugin serves {', '.join(PROCESSORS)}"
        )
    return named


def load_glm_processor(ctx: ModelContext) -> Any:
    """The processor the folder names, with the image backend of option ``backend``."""
    parts = PROCESSORS[processor_class_name(ctx)]
    backend = chosen_backend(ctx)
    folder = str(ctx.require_model_path())
    extra = dict(ctx.processor_options.hf_processor_kwargs)
    image_class = parts.pil if backend == "pil" else parts.torchvision
    image_processor = image_class.from_pretrained(folder, local_files_only=True, **extra)
    video_processor = parts.video.from_pretrained(folder, local_files_only=True, **extra)
    return parts.processor.from_pretrained(
        folder,
        local_files_only=True,
        image_processor=image_processor,
        video_processor=video_processor,
    )
