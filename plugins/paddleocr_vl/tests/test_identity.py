"""mmproc's PaddleOCR-VL output equals calling the transformers processor directly.

The folders are written by ``mmproc.testing`` with the model's real special tokens and hub
preprocessor settings (patch 14, merge 2, temporal patch 1, min_pixels 147384, max_pixels 2822400,
mean / std 0.5, bicubic). The reference is transformers' ``AutoProcessor`` on the same folder with
the chosen ``backend``, built without the plugin, called with ``text=[prompt], images=...,
return_tensors="pt"``. What must match: prompt ids, per-item patches (concatenated in item
order), grids, and placeholder ranges (the runs of ``<|IMAGE_PLACEHOLDER|>`` in transformers'
ids). With device normalisation on (the default) mmproc's pixels are uint8 and ``FusedInputNorm``
of them must come within 1e-6 of transformers' float pixels; with it off they must be equal. The
matrix shared with other image models is the kit's (``mmproc.testing.identity``); PaddleOCR-VL's
own checks follow it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import mmproc
import torch
from mmproc.testing import call_hf_processor, noise_image
from mmproc.testing.identity import BACKENDS, ImageIdentityMatrix
from mmproc_paddleocr_vl.demo import write_paddleocr_vl_folder
from PIL import Image
from transformers.models.paddleocr_vl.image_processing_paddleocr_vl import (
    PaddleOCRVLImageProcessor,
)
from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
    PaddleOCRVLImageProcessorPil,
)

IMAGE = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
PAD = "<|IMAGE_PLACEHOLDER|>"


class TestPaddleOCRVLIdentity(ImageIdentityMatrix):
    image = IMAGE
    prompt = "OCR: {image}"
    placeholder_tokens: ClassVar[dict[str, str]] = {"image": PAD}
    image_processor_classes: ClassVar[dict[str, type]] = {
        "pil": PaddleOCRVLImageProcessorPil,
        "torchvision": PaddleOCRVLImageProcessor,
    }
    # The real PaddleOCR-VL hub settings the folders carry; the processor must load exactly these.
    settings: ClassVar[dict[str, Any]] = {
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 1,
        "min_pixels": 147384,
        "max_pixels": 2822400,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "resample": int(Image.Resampling.BICUBIC),
    }
    tokenizer_text = f"<|begin_of_sentence|>User: {IMAGE}read the text, please\nAssistant:\n"
    single_tokens = ("<|IMAGE_START|>", PAD, "<|IMAGE_END|>")
    # Sizes on either side of min_pixels and between the bounds, besides the kit's.
    sizes = (*ImageIdentityMatrix.sizes, (384, 384), (613, 411))
    kwargs_image = (1500, 1200)
    kwargs_budgets = (1000, 500)
    write_folder = staticmethod(write_paddleocr_vl_folder)

    @classmethod
    def build_reference(cls, folder: Path, backend: str) -> Any:
        """transformers' processor for ``folder`` and ``backend``, built without the plugin."""
        from transformers import AutoProcessor

        reference = AutoProcessor.from_pretrained(folder, local_files_only=True, backend=backend)
        assert isinstance(reference.image_processor, cls.image_processor_classes[backend])
        return reference

    def check_large_image(self, processor: mmproc.Processor, out: Any, hf: Any) -> None:
        # Brought down to max_pixels: the grid's area is at most 2822400 pixels.
        _, grid_h, grid_w = hf["image_grid_thw"][0].tolist()
        assert grid_h * grid_w * 14 * 14 <= self.settings["max_pixels"]

    def check_loaded_processor(self, hf_processor: Any) -> None:
        assert type(hf_processor).__name__ == "PaddleOCRVLProcessor"

    def layout_request(self) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
        images = [noise_image(70, 35, "LA", seed=9000), noise_image(500, 700, seed=9001)]
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "OCR:"}]
        return [{"role": "user", "content": content}], {"image": images}

    # --- PaddleOCR-VL's own ---------------------------------------------------------------------

    def test_pixels_are_raw_uint8_with_device_normalisation(
        self, processors: Any, references: Any
    ) -> None:
        """The uint8 patches are transformers' pixels with rescale and normalise off, exactly."""
        images = [noise_image(90, 60, "RGBA", seed=6000), noise_image(17, 333, "L", seed=6001)]
        prompt = f"{IMAGE}{IMAGE}"
        for backend in BACKENDS:
            out = processors[(backend, True)].process(prompt, {"image": images})
            raw = call_hf_processor(
                references[backend], prompt, {"image": images}, do_rescale=False, do_normalize=False
            )
            raw_pixels = raw["pixel_values"]
            assert torch.equal(raw_pixels.round(), raw_pixels)  # whole numbers
            pixels = torch.cat([f.data["pixel_values"] for f in out.features])
            assert pixels.dtype == torch.uint8
            assert torch.equal(pixels, raw_pixels.to(torch.uint8)), backend
