"""mmproc's InternVL3 output equals transformers' ``InternVLProcessor`` called directly.

The reference is built without the plugin: ``AutoProcessor`` on the demo folder with the chosen
backend's image processor (``GotOcr2ImageProcessor`` or ``GotOcr2ImageProcessorPil``), called
with ``text=[prompt], images=..., videos=..., return_tensors="pt"``. It returns one
``pixel_values`` holding every tile and frame in prompt order; ``conftest.as_items`` cuts it into
mmproc's items. What must match: prompt ids, each image's tiles and tile count, each video's
frames, placeholder ranges (only ``<IMG_CONTEXT>`` embeds); with device normalisation
``FusedInputNorm`` of the uint8 pixels within 1e-6 of transformers' floats, without it equal.

The matrix shared with other two-backend image models is the kit's
(``mmproc.testing.identity.ImageIdentityMatrix``): every size in every Pillow mode, both folder
layouts, the tokenizer, the backend option. Its checks of grid models' limits (a 200:1 aspect
ratio, pixel budgets, a grid's size) do not apply to tiling, and InternVL's own follow.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import mmproc
import numpy as np
import pytest
import torch
from mmproc.testing import call_hf_processor, noise_image, noise_video
from mmproc.testing.identity import BACKENDS, ImageIdentityMatrix
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_internvl.demo import write_internvl3_folder
from mmproc_internvl.model import video_frame_ids
from PIL import Image
from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.processing_internvl import InternVLProcessor

IMAGE, VIDEO = "<IMG_CONTEXT>", "<video>"


class TestInternVL3Identity(ImageIdentityMatrix):
    image = IMAGE
    placeholder_tokens: ClassVar[dict[str, str]] = {"image": IMAGE, "video": IMAGE}
    image_processor_classes: ClassVar[dict[str, type]] = {
        "pil": GotOcr2ImageProcessorPil,
        "torchvision": GotOcr2ImageProcessor,
    }
    # The hub folder's settings, as the image processor must load them (crop_to_patches is
    # false there: InternVLProcessor turns it on at every call).
    settings: ClassVar[dict[str, Any]] = {
        "crop_to_patches": False,
        "min_patches": 1,
        "max_patches": 12,
        "image_mean": (0.485, 0.456, 0.406),
        "image_std": (0.229, 0.224, 0.225),
        "resample": int(Image.Resampling.BICUBIC),
    }
    tokenizer_text = f"<|im_start|>user\n{IMAGE}\ndescribe the picture, please<|im_end|>"
    single_tokens = ("<img>", "</img>", IMAGE, VIDEO)
    # (width, height): tiny, thin both ways, one tile exactly, just over, odd.
    sizes = ((1, 1), (10, 1000), (1000, 10), (2010, 10), (448, 448), (449, 448), (57, 113))
    write_folder = staticmethod(write_internvl3_folder)

    # Grid models' checks that do not apply to tiling (InternVL's own versions are below): no
    # aspect ratio is refused, the budget is a tile count, and no grid says an image's size.
    test_per_request_hf_kwargs_match_hf_and_are_part_of_the_cache_key = None
    test_a_bad_item_in_a_multi_image_request_fails_it_and_the_next_is_served = None
    test_beyond_200_to_1_is_a_clear_error_and_the_processor_keeps_serving = None
    test_large_4000x3000_image_matches_hf = None

    @pytest.fixture(autouse=True)
    def _checker(self, like_transformers: Callable[..., None]) -> None:
        self.like_transformers = like_transformers

    def assert_identical(self, out: Any, hf: Any, tokenizer: Any, **kwargs: Any) -> None:
        """``out`` equals transformers' merged outputs ``hf``, cut into items (the kit's check,
        with conftest's fields: the matrix's ``fields`` are not used)."""
        self.like_transformers(out, hf, tokenizer, **kwargs)

    def check_loaded_processor(self, hf_processor: Any) -> None:
        assert isinstance(hf_processor, InternVLProcessor)
        assert hf_processor.image_seq_length == 256

    def layout_request(self) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
        image, video = noise_image(70, 35, "LA", seed=9000), noise_video(2, 40, 30, seed=9001)
        content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare"}]
        return [{"role": "user", "content": content}], {"image": [image], "video": [video]}

    # --- InternVL's own -------------------------------------------------------------------------

    def check(self, combo: Any, prompt: str, mm_data: dict[str, list[Any]], **kwargs: Any) -> Any:
        """One request through mmproc and through transformers, which must agree."""
        processor, reference, norm = combo
        out = processor.process(prompt, mm_data, hf_kwargs=kwargs or None)
        hf = call_hf_processor(reference, prompt, mm_data, **kwargs)
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm, context=prompt[:40])
        return out

    def test_odd_sizes_together_in_one_request_match_hf(self, combo: Any) -> None:
        sizes = [(3, 2), (1500, 60), (60, 1500), (1000, 700), (301, 39), (17, 333)]
        images = [
            noise_image(w, h, "RGBA" if i % 2 else "RGB", seed=100 + i)
            for i, (w, h) in enumerate(sizes)
        ]
        out = self.check(combo, f"look: {IMAGE * len(images)} and compare", {"image": images})
        assert [f.placeholder.length for f in out.features] == [
            2 + 256 * int(f.data["num_patches"]) for f in out.features
        ]

    def test_a_large_image_gets_the_full_twelve_tiles_and_a_thumbnail(self, combo: Any) -> None:
        image = noise_image(4000, 3000, seed=200).convert("RGB")
        out = self.check(combo, f"{IMAGE} what is it?", {"image": [image]})
        # 4:3 is a grid of 4 x 3 tiles: the twelve the folder allows, then the thumbnail.
        assert int(out.features[0].data["num_patches"]) == 13

    def test_one_tile_has_no_thumbnail_and_more_tiles_have_one(self, combo: Any) -> None:
        square, wide = noise_image(448, 448, seed=300), noise_image(896, 448, seed=301)
        out = self.check(combo, f"{IMAGE}{IMAGE}", {"image": [square, wide]})
        assert [int(f.data["num_patches"]) for f in out.features] == [1, 3]

    def test_the_folder_says_no_cropping_but_the_processor_tiles(self, folder: Path) -> None:
        saved = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
        assert saved["crop_to_patches"] is False
        with mmproc.get_processor(folder) as processor:
            assert processor.hf_processor.image_processor.crop_to_patches is False
            out = processor.process(IMAGE, {"image": [noise_image(900, 300, seed=400)]})
        assert int(out.features[0].data["num_patches"]) == 4  # 3 x 1 tiles and the thumbnail

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_a_tile_limit_per_request_matches_hf_and_keys_the_cache(
        self, processors: Any, references: Any, backend: str
    ) -> None:
        processor, reference = processors[(backend, True)], references[backend]
        image = noise_image(1200, 800, seed=500)
        tiles = []
        for kwargs in ({}, {"max_patches": 6}, {"max_patches": 2}, {"max_patches": 1}, {}):
            before = processor.cache.stats()
            out = self.check(
                (processor, reference, True), f"{IMAGE} small", {"image": [image]}, **kwargs
            )
            tiles.append(int(out.features[0].data["num_patches"]))
            hit = processor.cache.stats().hits - before.hits
            assert hit == (1 if len(tiles) == 5 else 0), kwargs  # only the repeat is a hit
        assert tiles == [7, 7, 3, 1, 7]  # 3 x 2 (+1), 3 x 2 (+1), 2 x 1 (+1), one tile

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_a_folder_with_another_tile_limit_is_read(self, tmp_path: Path, backend: str) -> None:
        folder = write_internvl3_folder(tmp_path / "six", max_patches=6)
        reference = self.build_reference(folder, backend)
        image = noise_image(1600, 400, seed=600)
        with mmproc.get_processor(folder, backend=backend) as processor:
            out = self.check((processor, reference, True), f"{IMAGE}!", {"image": [image]})
        assert int(out.features[0].data["num_patches"]) == 5  # 4 x 1 within six, and thumbnail

    def test_videos_of_several_lengths_match_hf(self, combo: Any) -> None:
        processor, reference, _ = combo
        videos = [noise_video(frames, 64, 48, seed=700 + frames) for frames in (1, 2, 5, 8)]
        for video in videos:
            self.check(combo, f"<|im_start|>user\n{VIDEO}\nWhat happens?", {"video": [video]})
        # transformers stacks a call's videos and refuses several lengths in one; mmproc serves
        # them, each as transformers gives it alone.
        prompt = f"{VIDEO}\n{VIDEO}\n"
        out = processor.process(prompt, {"video": videos[1:3]})
        with pytest.raises(ValueError, match="stack"):
            call_hf_processor(reference, prompt, {"video": videos[1:3]})
        for feature, video in zip(out.features, videos[1:3]):
            alone = processor.process(VIDEO, {"video": [video]}).features[0]
            assert torch.equal(
                feature.data["pixel_values_videos"], alone.data["pixel_values_videos"]
            )
            assert feature.placeholder.length == alone.placeholder.length

    @pytest.mark.parametrize("before", ["", "\n", "Watch ", "Watch: ", "end.\n\n"])
    def test_a_video_expands_as_transformers_writes_it_after_any_line_start_or_space(
        self, combo: Any, before: str
    ) -> None:
        # " Frame1:" is one token after a space: the space and the placeholder go together.
        video = noise_video(2, 40, 30, seed=800)
        out = self.check(combo, f"{before}{VIDEO} now", {"video": [video]})
        ids = out.prompt_token_ids[out.features[0].placeholder.offset :]
        lead = " " if before.endswith(" ") else ""
        hf_processor = combo[1]
        assert ids[: len(video_frame_ids(hf_processor, 2, lead))] == video_frame_ids(
            hf_processor, 2, lead
        )

    def test_images_and_videos_in_one_request_match_hf(self, combo: Any) -> None:
        images = [noise_image(640, 480, seed=900), noise_image(33, 90, "P", seed=901)]
        videos = [noise_video(3, 56, 56, seed=902), noise_video(3, 90, 30, seed=903)]
        prompt = f"{IMAGE}\n{VIDEO}\nthen {IMAGE} and\n{VIDEO}\ncompare"
        out = self.check(combo, prompt, {"image": images, "video": videos})
        assert [f.modality for f in out.features] == ["image", "video", "image", "video"]

    def test_a_chat_with_an_image_and_a_video_is_what_transformers_renders(
        self, combo: Any
    ) -> None:
        processor, reference, norm = combo
        image, video = noise_image(300, 200, seed=1000), noise_video(3, 64, 48, seed=1001)
        url = "data:image/png;base64," + _png(image)
        question = {"type": "text", "text": "What changes?"}
        ours = [{"type": "image_url", "image_url": {"url": url}}, {"type": "video", "video": video}]
        out = processor.process_chat([{"role": "user", "content": [*ours, question]}])
        theirs = [{"type": "image", "image": image}, {"type": "video", "video": video}, question]
        hf = reference.apply_chat_template(
            [{"role": "user", "content": theirs}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            sanitize_control_tokens=True,
        )
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm)

    def test_a_video_file_is_sampled_and_expands_by_its_frames(
        self, processors: Any, references: Any, tmp_path: Path
    ) -> None:
        from mmproc.inputs import parse_mm_data
        from mmproc.plugin import hf_video_kwargs

        clip = tmp_path / "clip.mp4"
        clip.write_bytes(encode_video(numbered_frames(30), fps=10))  # 3 s at 10 fps
        processor, reference = processors[("torchvision", False)], references["torchvision"]
        prompt = f"<|im_start|>user\n{VIDEO}\nWhat happens?<|im_end|>"
        out = processor.process(prompt, {"video": [str(clip)]})
        (decoded,) = parse_mm_data({"video": [str(clip)]}, media=processor.media)["video"]
        assert decoded.frames.shape[0] == 6  # 2 fps over 3 s
        hf = reference(text=[prompt], **hf_video_kwargs([decoded]), return_tensors="pt")
        self.assert_identical(out, hf, reference.tokenizer, normalised=False)

    def test_a_bad_item_fails_its_request_and_the_next_is_served(self, combo: Any) -> None:
        processor, _, _ = combo
        good = noise_image(40, 50, seed=1100)
        with pytest.raises(mmproc.MediaItemError, match="image item 1"):
            processor.process(f"{IMAGE}{IMAGE}", {"image": [good, b"not an image"]})
        self.check(combo, f"{IMAGE} again", {"image": [good]})

    def test_a_video_frame_missing_its_pixels_is_named(self, combo: Any) -> None:
        processor, _, _ = combo
        frames = [np.zeros((20, 30, 3), np.uint8), np.zeros((20, 31, 3), np.uint8)]
        with pytest.raises(mmproc.MediaItemError, match=r"video item 0: .*frame 1"):
            processor.process(VIDEO, {"video": [frames]})


def _png(image: Image.Image) -> str:
    import io

    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()
