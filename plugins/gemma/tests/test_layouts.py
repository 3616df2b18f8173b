"""Every family's folder loads alike in the hub's layout and in the one transformers'
``save_pretrained`` writes (``processor_config.json`` holding every part's settings), the
folder's settings served in both (pan-and-scan on, Gemma 3n's RGB conversion)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mmproc
import pytest
import torch
from mmproc.plugin import resave_with_processor
from mmproc.testing import noise_image


@pytest.mark.parametrize("name", ["gemma3-pan-and-scan", "gemma3n", "gemma4"])
def test_a_save_pretrained_folder_gives_what_the_hub_folder_gives(
    folders: Any, tmp_path: Path, backend: str, name: str
) -> None:
    hub = folders(name)
    saved = resave_with_processor(hub, tmp_path / "saved")
    assert (saved / "processor_config.json").is_file()
    assert not (saved / "preprocessor_config.json").exists()
    images = [noise_image(1200, 400, seed=800), noise_image(50, 70, "L", seed=801)]
    with (
        mmproc.get_processor(hub, backend=backend) as ours,
        mmproc.get_processor(saved, backend=backend) as resaved,
    ):
        prompt = ours.model.get_dummy_text(ours.ctx, {"image": 2})
        a, b = (p.process(prompt, {"image": images}) for p in (ours, resaved))
    assert a.prompt_token_ids == b.prompt_token_ids
    for x, y in zip(a.features, b.features, strict=True):
        assert x.placeholder == y.placeholder
        assert torch.equal(x.data["pixel_values"], y.data["pixel_values"])
    pixels = a.features[0].data["pixel_values"]
    if name == "gemma3-pan-and-scan":
        assert pixels.shape[0] == 4  # the image and its 3 crops
    if name == "gemma3n":
        assert a.features[1].data["pixel_values"].shape[0] == 3  # grayscale, converted
