"""Build a Sarashina2-Vision processor from a local model folder, without the folder's code.

The model's own processor is remote code written for transformers 4.47; it does not import under
transformers 5 (it takes ``VideoInput`` from ``transformers.image_utils``). Its image processor is
4.47's Qwen2-VL one, so the processor is assembled here from transformers' parts, every setting
read from the folder's JSON files: the tokenizer (``tokenizer.json`` / ``tokenizer.model``),
transformers' Qwen2-VL image processor of the chosen backend configured from
``preprocessor_config.json``, and the chat template of ``chat_template.json``. The folder's Python
files are never imported or executed.

The model's ``_preprocess`` accepts only the keywords of 4.47's Qwen2-VL image processor (the
resize, rescale, normalise and RGB switches) and reads sizes and patch settings from the
instance. :func:`install_preprocess_kwarg_filter` gives the image processor the same contract
under transformers 5: whatever else a caller passes (``size``, ``patch_size``,
``temporal_patch_size``, ``merge_size``, ``do_pad``, ...) is dropped, and the instance's own
values are used, as the model's processor ignores them. The filter is bound with
``types.MethodType``: ``copy.deepcopy`` rebinds it to each worker's clone, where a closure over
the original would make every worker call into the one original image processor.
"""

from __future__ import annotations

import types
from typing import Any

from mmproc.plugin import (
    ModelContext,
    ProcessorLoadError,
    read_chat_template,
    read_json_object,
)
from mmproc_qwen_vl.shared import chosen_backend, qwen2_vl_image_processor_class
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

__all__ = [
    "IMAGE_MARKERS",
    "MODEL_PREPROCESS_KWARGS",
    "Sarashina2VisionProcessor",
    "check_image_markers",
    "install_preprocess_kwarg_filter",
    "load_sarashina2_processor",
]

#: The keywords the model's own ``_preprocess`` (transformers 4.47's Qwen2-VL one) accepts.
MODEL_PREPROCESS_KWARGS = frozenset(
    {
        "do_resize",
        "resample",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
        "do_convert_rgb",
        "data_format",
        "input_data_format",
    }
)

# How transformers 5 calls `_preprocess`, not a setting of the model: passed on as given.
_CALL_KWARGS = frozenset({"return_tensors", "disable_grouping"})

# preprocessor_config.json keys the image processor is built from (the rest is ignored).
_IMAGE_SETTINGS = (
    "min_pixels",
    "max_pixels",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "image_mean",
    "image_std",
    "resample",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "do_convert_rgb",
)


class Sarashina2VisionProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor with Sarashina2-Vision's image token (``<|file|>``).

    Each image token in the prompt expands to ``prod(image_grid_thw) / merge_size**2`` copies of
    itself, as the model's own processor does; ``<|prefix|>`` and ``<|suffix|>`` around it stay
    single tokens. Images only: the model takes no video.
    """

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        image_token: str = "<|file|>",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=chat_template,
            **kwargs,
        )
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)


def _preprocess_with_the_models_kwargs(self: Any, images: Any, **kwargs: Any) -> Any:
    """``_preprocess`` with Sarashina2-Vision's keywords only; sizes and patch settings are the
    instance's. Bound to an image processor by :func:`install_preprocess_kwarg_filter`."""
    from transformers.image_utils import SizeDict

    kept = {k: v for k, v in kwargs.items() if k in MODEL_PREPROCESS_KWARGS or k in _CALL_KWARGS}
    size = self.size if isinstance(self.size, SizeDict) else SizeDict(**self.size)
    return type(self)._preprocess(
        self,
        images,
        size=size,
        patch_size=self.patch_size,
        temporal_patch_size=self.temporal_patch_size,
        merge_size=self.merge_size,
        **kept,
    )


def install_preprocess_kwarg_filter(image_processor: Any) -> Any:
    """Give ``image_processor`` the model's ``_preprocess`` contract (see the module docs), bound
    with ``types.MethodType`` so that deep copies rebind it; returns the image processor."""
    image_processor._preprocess = types.MethodType(
        _preprocess_with_the_models_kwargs, image_processor
    )
    return image_processor


#: The model's image markers as its chat template writes them, by their config.json id keys.
IMAGE_MARKERS = {
    "start_image_token_index": "<|prefix|>",
    "image_token_index": "<|file|>",
    "end_image_token_index": "<|suffix|>",
}


def check_image_markers(ctx: ModelContext, tokenizer: Any) -> None:
    """Each id ``config.json`` gives the image markers is that marker in the folder's tokenizer.

    Prompts write the markers as text (the chat template does); the ids are the model's (the
    tokenizer's and ``config.json``'s). A folder where the two disagree is refused.
    """
    for key, marker in IMAGE_MARKERS.items():
        index = ctx.config.get(key)
        if not isinstance(index, int) or isinstance(index, bool):
            raise ProcessorLoadError(
                f"{ctx.architecture} (plugin {ctx.plugin!r}): config.json has no integer {key} "
                f"(got {index!r})"
            )
        found = tokenizer.convert_tokens_to_ids(marker)
        if found != index:
            raise ProcessorLoadError(
                f"{ctx.architecture} (plugin {ctx.plugin!r}): config.json's {key} is {index}, "
                f"but the folder's tokenizer gives {marker} the id {found}"
            )


def load_sarashina2_processor(ctx: ModelContext) -> Sarashina2VisionProcessor:
    """The processor for ``ctx``'s folder, with the image backend of option ``backend``."""
    backend = chosen_backend(ctx)
    ImageProcessor = qwen2_vl_image_processor_class(backend)
    folder = ctx.require_model_path()
    from transformers import AutoTokenizer, PretrainedConfig

    preprocessor = read_json_object(ctx, "preprocessor_config.json")
    settings = {key: preprocessor[key] for key in _IMAGE_SETTINGS if key in preprocessor}
    settings.update(ctx.processor_options.hf_processor_kwargs)
    # The folder's config names a model transformers does not know: the tokenizer is read from
    # its own files (tokenizer_config.json says which class), not through that config.
    tokenizer = AutoTokenizer.from_pretrained(
        str(folder), local_files_only=True, config=PretrainedConfig()
    )
    check_image_markers(ctx, tokenizer)
    image_processor = install_preprocess_kwarg_filter(ImageProcessor(**settings))
    return Sarashina2VisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=read_chat_template(folder),
        image_token=IMAGE_MARKERS["image_token_index"],
    )
