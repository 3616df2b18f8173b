"""Both folder layouts are told apart by ``config.json`` (they name the same architecture), and a
config of neither is refused, saying what it has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mmproc
import pytest
from mmproc.plugin import ProcessorLoadError
from mmproc_ernie45_vl.layout import Layout, detect_layout
from mmproc_ernie45_vl.original import Ernie45VLOriginalProcessor
from transformers.models.ernie4_5_vl_moe.processing_ernie4_5_vl_moe import Ernie4_5_VLMoeProcessor


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        ({"model_type": "ernie4_5_moe_vl", "im_patch_id": 100295}, Layout.ORIGINAL),
        (
            {"model_type": "ernie4_5_vl_moe", "text_config": {}, "vision_config": {}},
            Layout.CONVERTED,
        ),
        # No model_type: each layout's own keys.
        ({"im_patch_id": 100295, "spatial_conv_size": 2}, Layout.ORIGINAL),
        ({"text_config": {}, "vision_config": {}, "image_token_id": 100295}, Layout.CONVERTED),
    ],
)
def test_each_layout_is_recognised_from_its_config(config: dict[str, Any], layout: Layout) -> None:
    assert detect_layout(config) is layout


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "ernie4_5_moe", "hidden_size": 2560},
        {"im_patch_id": 100295, "text_config": {}, "vision_config": {}},
        {},
    ],
)
def test_a_config_of_neither_layout_is_refused_naming_what_it_has(config: dict[str, Any]) -> None:
    with pytest.raises(ProcessorLoadError) as caught:
        detect_layout(config)
    message = str(caught.value)
    keys = (
        "im_patch_id",
        "spatial_conv_size",
        "temporal_conv_size",
        "text_config",
        "vision_config",
    )
    found = ", ".join(key for key in keys if key in config) or "none"
    assert f"model_type is {config.get('model_type')!r} and it has {found} of the keys" in message
    assert "Expected model_type 'ernie4_5_moe_vl' (the original layout" in message


def test_each_demo_folder_gets_its_layouts_processor(
    converted_folder: Path, original_folder: Path
) -> None:
    with mmproc.get_processor(converted_folder) as converted:
        assert type(converted.hf_processor) is Ernie4_5_VLMoeProcessor
    with mmproc.get_processor(original_folder) as original:
        assert type(original.hf_processor) is Ernie45VLOriginalProcessor
    assert converted.ctx.architecture == original.ctx.architecture


def test_a_folder_of_another_ernie_model_is_refused_when_the_processor_is_built(
    original_folder: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(original_folder, tmp_path / "text-only")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "ernie4_5_moe"
    del config["im_patch_id"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ProcessorLoadError, match=r"model_type is 'ernie4_5_moe' and it has"):
        mmproc.get_processor(folder)
