"""mmproc's Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 output equals calling the transformers
processor directly.

The folders are written by ``mmproc.testing`` with the models' real special tokens and hub
preprocessor settings (Qwen2-VL: patch 14, merge 2, temporal patch 2, min_pixels 3136,
max_pixels 12845056, CLIP mean / std, bicubic; Qwen3-VL and Qwen3.5: patch 16, 65536 to
16777216 pixels, mean / std 0.5). The reference is a transformers processor built independently
of the plugin: ``AutoProcessor`` on the same folder with the chosen backend's image processor class,
called with ``text=[prompt], images=..., videos=..., return_tensors="pt"``. What must match:
prompt ids, per-item tensors (concatenated in item order), grids, and placeholder ranges (the runs
of pad tokens in transformers' ids). With device normalisation on (the default) mmproc's pixels
are uint8 and ``FusedInputNorm`` of them must come within 1e-6 of transformers' float pixels;
with it off they must be equal. The matrix shared with other image models is the kit's
(``mmproc.testing.identity.ImageIdentityMatrix``); :class:`QwenIdentity` adds what every Qwen
family checks (the native uint8 paths, token counts), and each family's class its own. Qwen3's
videos, with their timestamps, are tested in ``test_qwen3_video.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import mmproc
import numpy as np
import pytest
import torch
from mmproc.plugin import BatchedField, ChannelLayout, FieldSpec, FlatField
from mmproc.testing import call_hf_processor, noise_image, noise_video
from mmproc.testing.identity import BACKENDS, GRID_FIELDS, ImageIdentityMatrix
from mmproc_qwen_vl import shared as qwen_shared
from mmproc_qwen_vl.demo import QWEN3_VARIANTS, write_qwen2_vl_folder, write_qwen3_vl_folder
from mmproc_qwen_vl.image_fast_path import ImageSizeError
from mmproc_qwen_vl.model import num_image_tokens
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def write_reference_copy(folder: Path, destination: Path) -> Path:
    """A copy of a Qwen2.5-VL hub folder whose image processor class transformers knows."""
    shutil.copytree(folder, destination)
    path = destination / "preprocessor_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["image_processor_type"] = "Qwen2VLImageProcessor"
    path.write_text(json.dumps(config), encoding="utf-8")
    return destination


class QwenIdentity(ImageIdentityMatrix):
    """The identity matrix of a Qwen family: the kit's, the native uint8 paths, token counts."""

    image = IMAGE
    placeholder_tokens: ClassVar[dict[str, str]] = {
        "image": "<|image_pad|>",
        "video": "<|video_pad|>",
    }
    image_processor_classes: ClassVar[dict[str, type]] = {
        "pil": Qwen2VLImageProcessorPil,
        "torchvision": Qwen2VLImageProcessor,
    }
    # How each output joins across items, as the test states it (not read from the plugin).
    fields: ClassVar[dict[str, FieldSpec]] = {
        **GRID_FIELDS,
        "pixel_values_videos": FlatField.from_grid("video", "video_grid_thw"),
        "video_grid_thw": BatchedField("video"),
        "second_per_grid_ts": BatchedField("video"),  # Qwen2.5-VL
    }
    tokenizer_text = f"<|im_start|>user\n{IMAGE}describe the picture, please<|im_end|>"
    single_tokens = ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>")
    # (width, height): tiny, thin, extreme (200:1 both ways, the largest ratio accepted), odd.
    sizes = (*ImageIdentityMatrix.sizes, (3, 600), (333, 77))

    def check_large_image(self, processor: mmproc.Processor, out: Any, hf: Any) -> None:
        length = out.features[0].placeholder.length
        assert num_image_tokens(processor.hf_processor, 3000, 4000) == length

    def test_pil_fast_path_is_taken_and_bit_identical(
        self, processors, references, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """PIL backend + device normalisation: images never go through transformers' float path."""
        calls: list[int] = []
        original = qwen_shared.patchify_uint8

        def spy(images: Any, **settings: Any) -> Any:
            calls.append(len(images))
            return original(images, **settings)

        monkeypatch.setattr(qwen_shared, "patchify_uint8", spy)
        reference = references["pil"]
        shapes = [(1, 1, "RGB"), (90, 60, "RGBA"), (200, 1, "P+transparency"), (17, 333, "L")]
        images = [noise_image(w, h, mode, seed=6000 + i) for i, (w, h, mode) in enumerate(shapes)]
        prompt = f"look {IMAGE}{IMAGE} and {IMAGE}{IMAGE}"
        out = processors[("pil", True)].process(prompt, {"image": images})
        assert calls == [4]
        raw = call_hf_processor(
            reference, prompt, {"image": images}, do_rescale=False, do_normalize=False
        )
        raw_pixels = raw["pixel_values"]
        assert raw_pixels.dtype == torch.float32
        whole = raw_pixels.to(torch.uint8).to(torch.float32)
        assert torch.equal(whole, raw_pixels)  # whole numbers
        pixels = torch.cat([f.data["pixel_values"] for f in out.features])
        assert pixels.dtype == torch.uint8
        assert torch.equal(pixels, raw_pixels.to(torch.uint8))
        self.assert_identical(
            out,
            call_hf_processor(reference, prompt, {"image": images}),
            reference.tokenizer,
            normalised=True,
        )

        # Not taken where it does not apply: torchvision backend, or normalisation on the CPU.
        for key in [("torchvision", True), ("pil", False)]:
            processors[key].process(IMAGE, {"image": [noise_image(33, 44, seed=6100)]})
        assert calls == [4]

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_num_image_tokens_equals_the_placeholder_length(self, processors, backend: str) -> None:
        processor = processors[(backend, True)]
        hf_processor = processor.hf_processor
        sizes = [*self.sizes, (640, 480), (1, 56), (1920, 1080)]
        for seed, (width, height) in enumerate(sizes):
            out = processor.process(
                IMAGE, {"image": [noise_image(width, height, seed=7000 + seed)]}
            )
            length = out.features[0].placeholder.length
            assert num_image_tokens(hf_processor, height, width) == length, (width, height)
            assert num_image_tokens(hf_processor.image_processor, height, width) == length
        with pytest.raises(ImageSizeError, match="aspect ratio"):
            num_image_tokens(hf_processor, 1, 201)


class TestQwen2VLIdentity(QwenIdentity):
    # The real Qwen2-VL hub settings the folders carry; the processors must load exactly these.
    settings: ClassVar[dict[str, Any]] = {
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "image_mean": (0.48145466, 0.4578275, 0.40821073),
        "image_std": (0.26862954, 0.26130258, 0.27577711),
        "resample": int(Image.Resampling.BICUBIC),
    }
    settings_components = ("image_processor", "video_processor")
    write_folder = staticmethod(write_qwen2_vl_folder)

    def check_loaded_processor(self, hf_processor: Any) -> None:
        assert isinstance(hf_processor.video_processor, Qwen2VLVideoProcessor)

    def layout_request(self) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
        image, video = noise_image(70, 35, "LA", seed=9000), noise_video(2, 40, 30, seed=9001)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}]}]
        return messages, {"image": [image], "video": [video]}

    def test_video_matches_hf(self, combo) -> None:
        processor, reference, norm = combo
        array = noise_video(4, 90, 60, seed=8000)
        odd = noise_video(3, 50, 70, seed=8001)  # an odd frame count: the last frame is repeated
        frames = [Image.fromarray(frame) for frame in noise_video(2, 33, 47, seed=8002)]
        tensor = torch.from_numpy(noise_video(2, 30, 20, seed=8005)).permute(0, 3, 1, 2)  # T,C,H,W
        gray = np.ascontiguousarray(noise_video(2, 40, 30, seed=8006)[..., :1])  # (T, H, W, 1)
        images = [noise_image(30, 40, seed=8003), noise_image(64, 20, "P", seed=8004)]
        if norm:
            assert "pixel_values_videos" in processor.norm_spec.pixel_keys
        # (prompt, mm_data, what transformers gets as images, as videos)
        cases: list[tuple[str, dict[str, Any], list[Any], list[Any]]] = [
            (f"watch {VIDEO} now", {"video": [array]}, [], [array]),
            (f"watch {VIDEO} now", {"video": frames}, [], [frames]),  # one video as a frame list
            (f"watch {VIDEO} now", {"video": [tensor]}, [], [tensor.contiguous()]),
            (f"watch {VIDEO} now", {"video": [gray]}, [], [gray]),
            (
                f"{IMAGE} then {VIDEO} then {VIDEO} and {IMAGE}",
                {"image": images, "video": [odd, array]},
                images,
                [odd, array],
            ),
        ]
        for index, (prompt, mm_data, images, videos) in enumerate(cases):
            out = processor.process(prompt, mm_data)
            hf = call_hf_processor(reference, prompt, {"image": images, "video": videos})
            self.assert_identical(
                out, hf, reference.tokenizer, normalised=norm, context=f"case {index}"
            )

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_qwen2_5_vl_hub_folder_naming_qwen2_5_vl_image_processor(
        self, tmp_path_factory: pytest.TempPathFactory, backend: str
    ) -> None:
        root = tmp_path_factory.mktemp("qwen2_5_vl")
        path = write_qwen2_vl_folder(
            root / "hub", variant="qwen2_5_vl", image_processor_type="Qwen2_5_VLImageProcessor"
        )
        written = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8"))
        assert written["image_processor_type"] == "Qwen2_5_VLImageProcessor"
        # The reference: the same folder, naming a class transformers has.
        reference = self.build_reference(write_reference_copy(path, root / "reference"), backend)
        assert type(reference).__name__ == "Qwen2_5_VLProcessor"
        images = [noise_image(50, 90, seed=9100), noise_image(300, 20, "RGBA", seed=9101)]
        video = noise_video(3, 60, 40, seed=9102)
        # Qwen2.5's tool-call tokens are added, non-special tokens: they must stay single ids.
        prompt = f"<tool_call>{IMAGE} then {VIDEO}</tool_call> and {IMAGE}"
        for norm in (True, False):
            with mmproc.get_processor(path, backend=backend, device_normalize=norm) as processor:
                assert type(processor.hf_processor).__name__ == "Qwen2_5_VLProcessor"
                assert isinstance(
                    processor.hf_processor.image_processor, self.image_processor_classes[backend]
                )
                self.assert_real_settings(processor.hf_processor)
                out = processor.process(prompt, {"image": images, "video": [video]})
            hf = call_hf_processor(reference, prompt, {"image": images, "video": [video]})
            assert "second_per_grid_ts" in hf
            self.assert_identical(
                out, hf, reference.tokenizer, normalised=norm, context=f"norm={norm}"
            )


# --- Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE -------------------------------------------------


class Qwen3Identity(QwenIdentity):
    """Qwen3-VL's and Qwen3.5's images: Qwen2-VL's image processor with 16-pixel patches."""

    # The real Qwen3-VL / Qwen3.5 hub image settings the folders carry.
    settings: ClassVar[dict[str, Any]] = {
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 65536,
        "max_pixels": 16777216,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "resample": int(Image.Resampling.BICUBIC),
    }
    variant: ClassVar[str]

    @classmethod
    def write_folder(cls, path: Path, layout: str = "hub") -> Path:  # type: ignore[override]
        return write_qwen3_vl_folder(path, variant=cls.variant, layout=layout)  # type: ignore[arg-type]

    def check_loaded_processor(self, hf_processor: Any) -> None:
        assert type(hf_processor) is Qwen3VLProcessor
        video = hf_processor.video_processor
        assert isinstance(video, Qwen3VLVideoProcessor)
        assert (video.patch_size, video.merge_size, video.temporal_patch_size) == (16, 2, 2)
        assert (video.size["shortest_edge"], video.size["longest_edge"]) == (4096, 25165824)
        assert (video.fps, video.min_frames, video.max_frames) == (2, 4, 768)
        assert tuple(video.image_mean) == tuple(video.image_std) == (0.5, 0.5, 0.5)
        tokenizer = "Qwen3_5Tokenizer" if self.variant.startswith("qwen3_5") else "Qwen2Tokenizer"
        assert type(hf_processor.tokenizer).__name__ == tokenizer

    def test_the_patch_layout_is_16_pixel_patches_of_two_frames(self, processors) -> None:
        spec = processors[("pil", True)].norm_spec
        assert spec.layout == ChannelLayout.flat_patches(16, 2)
        assert spec.mean == spec.std == (0.5, 0.5, 0.5)
        assert set(spec.pixel_keys) == {"pixel_values", "pixel_values_videos"}

    def test_the_torchvision_uint8_path_is_taken_and_bit_identical(
        self, processors, references, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        calls: list[int] = []
        original = qwen_shared.patchify_uint8_torch
        monkeypatch.setattr(
            qwen_shared,
            "patchify_uint8_torch",
            lambda images, **settings: calls.append(len(images)) or original(images, **settings),
        )
        images = [noise_image(w, h, seed=6200 + w) for w, h in [(31, 517), (640, 480), (2, 3)]]
        prompt = IMAGE * len(images)
        out = processors[("torchvision", True)].process(prompt, {"image": images})
        assert calls == [3]
        raw = call_hf_processor(
            references["torchvision"],
            prompt,
            {"image": images},
            do_rescale=False,
            do_normalize=False,
        )
        pixels = torch.cat([f.data["pixel_values"] for f in out.features])
        assert pixels.dtype == torch.uint8 and torch.equal(pixels, raw["pixel_values"])


class TestQwen3VLIdentity(Qwen3Identity):
    variant = "qwen3_vl"


class TestQwen3VLMoeIdentity(Qwen3Identity):
    variant = "qwen3_vl_moe"


class TestQwen35Identity(Qwen3Identity):
    variant = "qwen3_5"


class TestQwen35MoeIdentity(Qwen3Identity):
    variant = "qwen3_5_moe"


def test_every_qwen3_variant_has_an_identity_class() -> None:
    tested = {cls.variant for cls in Qwen3Identity.__subclasses__()}
    assert tested == set(QWEN3_VARIANTS)
