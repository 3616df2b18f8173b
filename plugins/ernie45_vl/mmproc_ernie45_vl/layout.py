"""Which of ERNIE-4.5-VL's two folder layouts a model folder has, read from its ``config.json``.

Both layouts name the same architecture (``Ernie4_5_VLMoeForConditionalGeneration``), so the
architecture alone does not decide:

* **original** (Baidu's hub repositories): a flat config, ``model_type`` ``"ernie4_5_moe_vl"``,
  the vision settings as top-level keys (``im_patch_id``, ``spatial_conv_size``,
  ``temporal_conv_size``), a remote-code processor that this plugin reimplements;
* **converted** (transformers' native support): ``model_type`` ``"ernie4_5_vl_moe"``, nested
  ``text_config`` and ``vision_config``, ``image_token_id`` / ``video_token_id``, processed by
  transformers' ``Ernie4_5_VLMoeProcessor``.

``model_type`` decides when it is one of the two; a folder without a known one is recognised by
the keys each layout has. Anything else is refused, naming what was found.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from mmproc.plugin import ProcessorLoadError

__all__ = ["CONVERTED_MODEL_TYPE", "ORIGINAL_MODEL_TYPE", "Layout", "detect_layout"]

ORIGINAL_MODEL_TYPE = "ernie4_5_moe_vl"
CONVERTED_MODEL_TYPE = "ernie4_5_vl_moe"

# Keys only the original's flat config has, and keys of the converted nested one.
_ORIGINAL_KEYS = ("im_patch_id", "spatial_conv_size", "temporal_conv_size")
_CONVERTED_KEYS = ("text_config", "vision_config")


class Layout(enum.Enum):
    """An ERNIE-4.5-VL folder layout."""

    ORIGINAL = "original"
    CONVERTED = "converted"


def detect_layout(config: Mapping[str, Any], *, where: str = "config.json") -> Layout:
    """The layout of a folder whose ``config.json`` is ``config``.

    Raises:
        ProcessorLoadError: neither layout's ``model_type`` nor its keys are there; the message
            says what was found.
    """
    model_type = config.get("model_type")
    if model_type == ORIGINAL_MODEL_TYPE:
        return Layout.ORIGINAL
    if model_type == CONVERTED_MODEL_TYPE:
        return Layout.CONVERTED
    nested = all(isinstance(config.get(key), Mapping) for key in _CONVERTED_KEYS)
    flat = "im_patch_id" in config
    if nested and not flat:
        return Layout.CONVERTED
    if flat and not nested:
        return Layout.ORIGINAL
    present = [key for key in (*_ORIGINAL_KEYS, *_CONVERTED_KEYS) if key in config]
    raise ProcessorLoadError(
        f"{where} is not an ERNIE-4.5-VL config of a layout this plugin knows: model_type is "
        f"{model_type!r} and it has {', '.join(present) or 'none'} of the keys "
        f"{', '.join((*_ORIGINAL_KEYS, *_CONVERTED_KEYS))}. Expected model_type "
        f"{ORIGINAL_MODEL_TYPE!r} (the original layout: flat, with im_patch_id) or "
        f"{CONVERTED_MODEL_TYPE!r} (transformers' converted layout: nested text_config and "
        "vision_config)"
    )
