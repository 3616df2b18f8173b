"""Build a Gemma 3 / 3n / 4 processor from a local model folder, with either image backend.

transformers' own processor classes are used as they are (``Gemma3Processor``,
``Gemma3nProcessor``, ``Gemma4Processor``), built by ``AutoProcessor`` with the image processor
of the chosen backend. Two of the folder's settings transformers does not serve, and the loaded
processor is set to serve them (so that calling it directly does what the folder says too):

* Gemma 3's pan-and-scan settings (``do_pan_and_scan`` and ``pan_and_scan_*`` in
  ``preprocessor_config.json``): the processor's own defaults (pan-and-scan off, crops of at
  least 256 pixels from an aspect ratio of 1.2, at most 4) win over the image processor's
  attributes, so a folder that switches it on gets no crops. The folder's values (those not
  ``null``) become the processor's defaults.
* Gemma 3n's ``do_convert_rgb`` is ``null`` in the released ``preprocessor_config.json``, so
  transformers passes a grayscale image on with 1 channel and an RGBA one with 4, which the
  model cannot take: such images are converted to RGB, as Gemma 3 and Gemma 4 convert them.

And one of mmproc's own: Gemma 4's video processor samples 32 frames of whatever it is given;
mmproc samples a video file itself (``media_format``: the same 32 frames) and hands the processor
the frames it sampled, so the loaded processor takes frames as they come (``do_sample_frames``
off), whoever calls it.
"""

from __future__ import annotations

import importlib
from typing import Any

from mmproc.plugin import ConfigurationError, ModelContext, ProcessorLoadError

__all__ = [
    "BACKENDS",
    "PAN_AND_SCAN_KEYS",
    "chosen_backend",
    "load_gemma_processor",
]

BACKENDS = ("torchvision", "pil")
"""The image backends of the ``backend`` option; the first is the default."""

PAN_AND_SCAN_KEYS = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)
"""Gemma 3's pan-and-scan settings."""

# architecture -> (processor class, {backend: image processor class}), as "module:Class".
_CLASSES: dict[str, tuple[str, dict[str, str]]] = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3Processor",
        {
            "torchvision": "gemma3.image_processing_gemma3:Gemma3ImageProcessor",
            "pil": "gemma3.image_processing_pil_gemma3:Gemma3ImageProcessorPil",
        },
    ),
    "Gemma3nForConditionalGeneration": (
        "Gemma3nProcessor",
        {
            "torchvision": "siglip.image_processing_siglip:SiglipImageProcessor",
            "pil": "siglip.image_processing_pil_siglip:SiglipImageProcessorPil",
        },
    ),
    "Gemma4ForConditionalGeneration": (
        "Gemma4Processor",
        {
            "torchvision": "gemma4.image_processing_gemma4:Gemma4ImageProcessor",
            "pil": "gemma4.image_processing_pil_gemma4:Gemma4ImageProcessorPil",
        },
    ),
}


def chosen_backend(ctx: ModelContext) -> str:
    """The ``backend`` option (``"torchvision"`` unless given), checked."""
    backend = ctx.option("backend", BACKENDS[0])
    if backend in BACKENDS:
        return str(backend)
    raise ConfigurationError(
        f"{ctx.architecture} (plugin {ctx.plugin!r}): backend must be "
        f"{' or '.join(map(repr, BACKENDS))}, not {backend!r}"
    )


def _image_processor_class(architecture: str, backend: str) -> Any:
    module, _, name = _CLASSES[architecture][1][backend].partition(":")
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def load_gemma_processor(ctx: ModelContext) -> Any:
    """The HF processor for ``ctx``'s folder, with the image backend of option ``backend`` and
    the folder's settings served (see the module docs)."""
    from transformers import AutoProcessor

    backend = chosen_backend(ctx)
    folder = str(ctx.require_model_path())
    expected, _ = _CLASSES[ctx.architecture]
    extra = dict(ctx.processor_options.hf_processor_kwargs)
    image_class = _image_processor_class(ctx.architecture, backend)
    image_processor = image_class.from_pretrained(folder, local_files_only=True, **extra)
    processor = AutoProcessor.from_pretrained(
        folder, local_files_only=True, image_processor=image_processor, **extra
    )
    if type(processor).__name__ != expected:
        raise ProcessorLoadError(
            f"{ctx.architecture}: the folder {folder} loads as {type(processor).__name__}, not "
            f"{expected} (check its model_type and processor_class)"
        )
    if expected == "Gemma3Processor":
        # The processor's images_kwargs win over the image processor's attributes: the
        # folder's pan-and-scan settings become the processor's (an instance attribute, which
        # each worker's deep copy keeps).
        folder_settings = {
            key: getattr(image_processor, key)
            for key in PAN_AND_SCAN_KEYS
            if getattr(image_processor, key, None) is not None
        }
        processor.images_kwargs = {**type(processor).images_kwargs, **folder_settings}
    if expected == "Gemma3nProcessor" and image_processor.do_convert_rgb is None:
        image_processor.do_convert_rgb = True  # null in the released config: see the module docs
    if expected == "Gemma4Processor":
        processor.videos_kwargs = {**type(processor).videos_kwargs, "do_sample_frames": False}
    return processor
