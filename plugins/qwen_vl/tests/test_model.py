"""Settings of a Qwen folder that change which path the plugin takes (and must stay correct)."""

from __future__ import annotations

import json
from pathlib import Path

import mmproc
import numpy as np
import pytest
import torch
from mmproc_qwen_vl.demo import write_qwen2_vl_folder
from PIL import Image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_folder(tmp_path_factory.mktemp("qwen") / "hub")


def picture(seed: int, size: tuple[int, int] = (90, 60)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_a_video_processor_normalising_differently_turns_device_normalisation_off(
    folder: Path, tmp_path: Path
) -> None:
    import shutil

    odd = shutil.copytree(folder, tmp_path / "odd")
    video_config = json.loads((odd / "preprocessor_config.json").read_text())
    video_config.update(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    (odd / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    video = np.random.default_rng(0).integers(0, 256, (2, 56, 56, 3), dtype=np.uint8)
    with mmproc.get_processor(odd) as proc:
        assert proc.norm_spec is None  # one spec cannot undo two normalisations
        out = proc.process(VIDEO, {"video": [video]})
        reference = proc.hf_processor(text=[VIDEO], videos=[video], return_tensors="pt")
        assert torch.equal(
            out.features[0].data["pixel_values_videos"], reference["pixel_values_videos"]
        )


@pytest.mark.parametrize("setting", [{"do_resize": False}, {"do_convert_rgb": False}])
def test_settings_the_uint8_path_cannot_reproduce_fall_back_to_transformers(
    folder: Path, setting: dict
) -> None:
    image = picture(1, (56, 84))
    with mmproc.get_processor(folder, backend="pil", hf_processor_kwargs=setting) as proc:
        assert proc.norm_spec is not None
        out = proc.process(IMAGE, {"image": [image]})
        raw = proc.hf_processor(
            text=[IMAGE], images=[image], return_tensors="pt", do_rescale=False, do_normalize=False
        )
        assert torch.equal(
            out.features[0].data["pixel_values"], raw["pixel_values"].to(torch.uint8)
        )


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_an_image_the_model_refuses_is_named_by_its_index_in_the_request(
    folder: Path, backend: str
) -> None:
    # A 300:1 image is one transformers refuses (aspect ratio over 200): the request's item 2,
    # even when item 0 was cached and only items 1 and 2 reach the processor.
    with mmproc.get_processor(folder, backend=backend) as proc:
        proc.process(IMAGE, {"image": [picture(0)]})
        with pytest.raises(mmproc.MediaItemError) as info:
            proc.process(IMAGE * 3, {"image": [picture(0), picture(1), picture(2, (600, 2))]})
    assert (info.value.modality, info.value.index) == ("image", 2)
    assert "aspect ratio" in str(info.value)
