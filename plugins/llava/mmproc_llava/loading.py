"""Build the LLaVA families' processors from a local model folder, on either image backend.

Each family is transformers' own processor class with its own image processor (torchvision, the
default, or PIL, by the ``backend`` option) and, for the video models, its video processor
(torchvision only, which is why ``AutoProcessor`` cannot give the PIL backend: the parts are
loaded one by one).

Each image's tiles are padded to the batch's largest count and no output says an image's own
count, so mmproc works it out from the image's size and ``image_grid_pinpoints``, which it reads
from ``config.json`` (``get_mm_fields`` sees the outputs, not the processor): the loader checks
that the processor tiles with those very pinpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmproc.plugin import ModelContext, ProcessorLoadError
from mmproc_qwen_vl.shared import chosen_backend
from transformers.models.llava_next.image_processing_llava_next import LlavaNextImageProcessor
from transformers.models.llava_next.image_processing_pil_llava_next import (
    LlavaNextImageProcessorPil,
)
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
from transformers.models.llava_next_video.processing_llava_next_video import (
    LlavaNextVideoProcessor,
)
from transformers.models.llava_next_video.video_processing_llava_next_video import (
    LlavaNextVideoVideoProcessor,
)
from transformers.models.llava_onevision.image_processing_llava_onevision import (
    LlavaOnevisionImageProcessor,
)
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.models.llava_onevision.processing_llava_onevision import (
    LlavaOnevisionProcessor,
)
from transformers.models.llava_onevision.video_processing_llava_onevision import (
    LlavaOnevisionVideoProcessor,
)

__all__ = ["FAMILIES", "Family", "grid_pinpoints", "load_llava_processor"]


@dataclass(frozen=True)
class Family:
    """One LLaVA family: transformers' processor and its parts."""

    processor: type[Any]
    image_processors: dict[str, type[Any]]
    """Backend -> image processor class."""
    video_processor: type[Any] | None


FAMILIES: dict[str, Family] = {
    "LlavaOnevisionForConditionalGeneration": Family(
        LlavaOnevisionProcessor,
        {"torchvision": LlavaOnevisionImageProcessor, "pil": LlavaOnevisionImageProcessorPil},
        LlavaOnevisionVideoProcessor,
    ),
    "LlavaNextForConditionalGeneration": Family(
        LlavaNextProcessor,
        {"torchvision": LlavaNextImageProcessor, "pil": LlavaNextImageProcessorPil},
        None,
    ),
    "LlavaNextVideoForConditionalGeneration": Family(
        LlavaNextVideoProcessor,
        {"torchvision": LlavaNextImageProcessor, "pil": LlavaNextImageProcessorPil},
        LlavaNextVideoVideoProcessor,
    ),
}
"""Architecture -> its family."""


def grid_pinpoints(ctx: ModelContext) -> list[tuple[int, int]]:
    """The ``(height, width)`` canvases an image may be tiled to, from ``config.json``."""
    pinpoints = ctx.config.get("image_grid_pinpoints")
    if not pinpoints:
        raise ProcessorLoadError(
            f"{ctx.architecture} (plugin {ctx.plugin!r}): config.json has no "
            "image_grid_pinpoints, which each image's tile count follows from"
        )
    return [(int(height), int(width)) for height, width in pinpoints]


def load_llava_processor(ctx: ModelContext) -> Any:
    """The family's processor for ``ctx``'s folder, with the image backend of option
    ``backend``."""
    family = FAMILIES[ctx.architecture]
    backend = chosen_backend(ctx)
    folder = str(ctx.require_model_path())
    extra = dict(ctx.processor_options.hf_processor_kwargs)
    parts = {
        "image_processor": family.image_processors[backend].from_pretrained(
            folder, local_files_only=True, **extra
        )
    }
    if family.video_processor is not None:
        parts["video_processor"] = family.video_processor.from_pretrained(
            folder, local_files_only=True, **extra
        )
    processor = family.processor.from_pretrained(folder, local_files_only=True, **parts)
    tiling = [tuple(map(int, p)) for p in processor.image_processor.image_grid_pinpoints]
    if tiling != grid_pinpoints(ctx):
        raise ProcessorLoadError(
            f"{ctx.architecture} (plugin {ctx.plugin!r}): the image processor tiles with "
            f"image_grid_pinpoints {tiling}, config.json says {grid_pinpoints(ctx)}; they must "
            "agree (mmproc counts each image's tiles with config.json's)"
        )
    return processor
