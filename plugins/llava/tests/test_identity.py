"""mmproc's LLaVA-OneVision, LLaVA-NeXT and LLaVA-NeXT-Video output equals transformers'
processors called directly.

The reference is built without the plugin: ``AutoProcessor`` on the demo folder with the chosen
backend's image processor, called with ``text=[prompt], images=..., videos=...,
return_tensors="pt"``. What must match: prompt ids, each image's tiles (transformers pads them to
the batch's largest count: joined back the same way), sizes, each video's frames, placeholder
ranges; with device normalisation ``FusedInputNorm`` of the uint8 pixels within 1e-6 of
transformers' floats, without it equal.

The matrix shared with other two-backend image models is the kit's
(``mmproc.testing.identity.ImageIdentityMatrix``), once per family; its checks of grid models'
limits (a 200:1 aspect ratio, pixel budgets, a grid's size) do not apply to anyres tiling, and
the families' own follow.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import mmproc
import pytest
import torch
from mmproc.fused_norm import FusedInputNorm
from mmproc.plugin import BatchedField, FieldSpec, PaddedField, ProcessorLoadError
from mmproc.testing import call_hf_processor, noise_image, noise_video
from mmproc.testing.identity import BACKENDS, ImageIdentityMatrix
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_llava.demo import NEXT_PINPOINTS, ONEVISION_PINPOINTS, write_llava_folder
from PIL import Image
from transformers.models.llava_next.image_processing_llava_next import LlavaNextImageProcessor
from transformers.models.llava_next.image_processing_pil_llava_next import (
    LlavaNextImageProcessorPil,
)
from transformers.models.llava_onevision.image_processing_llava_onevision import (
    LlavaOnevisionImageProcessor,
)
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

IMAGE, VIDEO = "<image>", "<video>"


class LlavaIdentity(ImageIdentityMatrix):
    """The matrix and the checks every LLaVA family shares."""

    image = IMAGE
    placeholder_tokens: ClassVar[dict[str, str]] = {"image": IMAGE, "video": VIDEO}
    # How each output joins across items, as the test states it (not read from the plugin):
    # tiles padded with zeros to the largest count along dim 1.
    fields: ClassVar[dict[str, FieldSpec]] = {
        "pixel_values": PaddedField("image", lengths=(), dim=1),
        "image_sizes": BatchedField("image"),
        "batch_num_images": BatchedField("image"),
        "pixel_values_videos": BatchedField("video"),
    }
    settings_components = ("image_processor",)
    single_tokens = (IMAGE,)
    sizes = ((1, 1), (10, 1000), (1000, 10), (2010, 10), (336, 336), (385, 384), (57, 113))
    tile: ClassVar[int]

    # Grid models' checks that do not apply to anyres tiling (the families' own are below): no
    # aspect ratio is refused, there is no pixel budget, and no grid says an image's size.
    test_per_request_hf_kwargs_match_hf_and_are_part_of_the_cache_key = None
    test_a_bad_item_in_a_multi_image_request_fails_it_and_the_next_is_served = None
    test_beyond_200_to_1_is_a_clear_error_and_the_processor_keeps_serving = None
    test_large_4000x3000_image_matches_hf = None

    def check(self, combo: Any, prompt: str, mm_data: dict[str, list[Any]], **kwargs: Any) -> Any:
        """One request through mmproc and through transformers, which must agree."""
        processor, reference, norm = combo
        out = processor.process(prompt, mm_data, hf_kwargs=kwargs or None)
        hf = call_hf_processor(reference, prompt, mm_data, **kwargs)
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm, context=prompt[:40])
        return out, hf

    def test_images_of_odd_sizes_in_one_request_keep_their_own_tiles(self, combo: Any) -> None:
        sizes = [(3, 2), (1500, 60), (60, 1500), (1000, 700), (301, 39), (17, 333)]
        images = [
            noise_image(w, h, "RGBA" if i % 2 else "RGB", seed=100 + i)
            for i, (w, h) in enumerate(sizes)
        ]
        out, hf = self.check(combo, f"look: {IMAGE * len(images)} and compare", {"image": images})
        tiles = [int(f.data["pixel_values"].shape[0]) for f in out.features]
        # transformers pads every image to the largest count with zero tiles; mmproc keeps each
        # image's own, and the padding is all that it leaves out.
        assert hf["pixel_values"].shape[1] == max(tiles) and min(tiles) < max(tiles)
        for row, count in zip(hf["pixel_values"], tiles):
            assert not row[count:].any()

    def test_a_large_image_is_tiled_on_its_best_canvas(self, combo: Any) -> None:
        from transformers.image_processing_utils import select_best_resolution

        image = noise_image(4000, 3000, seed=200).convert("RGB")
        out, _ = self.check(combo, f"{IMAGE} what is it?", {"image": [image]})
        height, width = select_best_resolution((3000, 4000), self.pinpoints)
        tiles = 1 + (height // self.tile) * (width // self.tile)
        assert out.features[0].data["pixel_values"].shape[0] == tiles > 4

    def test_wide_and_tall_images_lose_their_padding_rows_and_columns(self, combo: Any) -> None:
        # The same canvas for both, with the padding on other sides: other feature counts.
        wide, tall = noise_image(900, 250, seed=300), noise_image(250, 900, seed=301)
        out, _ = self.check(combo, f"{IMAGE}\n{IMAGE}", {"image": [wide, tall]})
        assert all(f.placeholder.length > 0 for f in out.features)

    def test_a_bad_item_fails_its_request_and_the_next_is_served(self, combo: Any) -> None:
        processor = combo[0]
        good = noise_image(40, 50, seed=1100)
        with pytest.raises(mmproc.MediaItemError, match="image item 1"):
            processor.process(f"{IMAGE}{IMAGE}", {"image": [good, b"not an image"]})
        self.check(combo, f"{IMAGE} again", {"image": [good]})

    def test_the_tiling_cannot_change_per_request(self, combo: Any) -> None:
        processor = combo[0]
        with pytest.raises(mmproc.MmprocError, match="image_grid_pinpoints cannot change"):
            processor.process(
                IMAGE,
                {"image": [noise_image(90, 60, seed=1200)]},
                hf_kwargs={"image_grid_pinpoints": [[self.tile, self.tile]]},
            )

    def test_config_and_image_processor_pinpoints_must_agree(self, folder: Path) -> None:
        other = [[self.tile, self.tile * 2]]
        with pytest.raises(ProcessorLoadError, match="must agree"):
            mmproc.get_processor(folder, hf_processor_kwargs={"image_grid_pinpoints": other})

    pinpoints: ClassVar[list[list[int]]]


class VideoChecks:
    """The video checks of the families that take video (mixed into their identity class)."""

    def video_tokens(self, frames: int) -> int:
        """The features of a video of ``frames`` frames: the family's pooling rule."""
        raise NotImplementedError

    def test_each_video_length_matches_hf_and_a_request_may_mix_them(self, combo: Any) -> None:
        processor, reference, norm = combo
        lengths = (1, 2, 5, 8)
        videos = [noise_video(n, 64, 48, seed=700 + n) for n in lengths]
        prompt = f"watch {VIDEO * len(videos)} now"
        # transformers stacks a call's videos, so it refuses these in one call; mmproc gives
        # each of them what transformers gives it in a call of its own.
        with pytest.raises(ValueError, match="stack"):
            call_hf_processor(reference, prompt, {"video": videos})
        out = processor.process(prompt, {"video": videos})
        assert [f.placeholder.length for f in out.features] == [
            self.video_tokens(n) for n in lengths
        ]
        for feature, video in zip(out.features, videos):
            hf = call_hf_processor(reference, VIDEO, {"video": [video]})
            frames = feature.data["pixel_values_videos"]
            if norm:
                assert feature.norm is not None
                frames = FusedInputNorm(feature.norm, dtype=torch.float32)(frames)
            assert torch.allclose(frames, hf["pixel_values_videos"][0], atol=1e-6, rtol=0)

    def test_images_and_videos_in_one_request_match_hf(self, combo: Any) -> None:
        images = [noise_image(640, 480, seed=900), noise_image(33, 90, "P", seed=901)]
        videos = [noise_video(3, 56, 56, seed=902), noise_video(3, 90, 30, seed=903)]
        prompt = f"{IMAGE} {VIDEO} then {IMAGE} and {VIDEO} compare"
        out, _ = self.check(combo, prompt, {"image": images, "video": videos})  # type: ignore[attr-defined]
        assert [f.modality for f in out.features] == ["image", "video", "image", "video"]

    def test_an_mp4_sampled_to_four_frames_is_what_transformers_makes_of_them(
        self, folder: Path, references: Any
    ) -> None:
        from mmproc.inputs import parse_mm_data
        from mmproc.media import VideoSampling
        from mmproc.plugin import hf_video_kwargs

        mp4 = encode_video(numbered_frames(40), fps=10)  # 4 s at 10 fps
        sampling = VideoSampling(num_frames=4)
        with mmproc.get_processor(folder, device_normalize=False, video_sampling=sampling) as ours:
            out = ours.process(f"{VIDEO} What happens?", {"video": [mp4]})
            (decoded,) = parse_mm_data({"video": [mp4]}, media=ours.media)["video"]
        assert decoded.metadata is not None and decoded.metadata.frame_indices == (0, 10, 20, 30)
        reference = references["torchvision"]
        hf = reference(
            text=[f"{VIDEO} What happens?"], **hf_video_kwargs([decoded]), return_tensors="pt"
        )
        self.assert_identical(out, hf, reference.tokenizer, normalised=False)  # type: ignore[attr-defined]
        assert out.features[0].placeholder.length == self.video_tokens(4)


class TestOneVisionIdentity(VideoChecks, LlavaIdentity):
    image_processor_classes: ClassVar[dict[str, type]] = {
        "pil": LlavaOnevisionImageProcessorPil,
        "torchvision": LlavaOnevisionImageProcessor,
    }
    settings: ClassVar[dict[str, Any]] = {
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "resample": int(Image.Resampling.BICUBIC),
        "image_grid_pinpoints": ONEVISION_PINPOINTS,
    }
    tokenizer_text = f"<|im_start|>user {IMAGE}\ndescribe the picture, please<|im_end|>"
    single_tokens = (IMAGE, VIDEO)
    write_folder = staticmethod(partial(write_llava_folder, variant="onevision"))
    tile = 384
    pinpoints = ONEVISION_PINPOINTS

    def video_tokens(self, frames: int) -> int:
        return frames * 14 * 14 + 1  # 27 x 27 features pooled to 14 x 14 a frame, a newline

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_a_tile_size_per_request_matches_hf_and_keys_the_cache(
        self, processors: Any, references: Any, backend: str
    ) -> None:
        processor, reference = processors[(backend, True)], references[backend]
        image = noise_image(800, 500, seed=500)
        lengths = []
        for kwargs in ({}, {"size": {"height": 192, "width": 192}}, {}):
            before = processor.cache.stats()
            out, _ = self.check(
                (processor, reference, True), f"{IMAGE} small", {"image": [image]}, **kwargs
            )
            lengths.append(out.features[0].placeholder.length)
            hit = processor.cache.stats().hits - before.hits
            assert hit == (1 if len(lengths) == 3 else 0), kwargs  # only the repeat is a hit
        assert lengths[0] == lengths[2] != lengths[1]

    def test_a_chat_of_one_image_is_what_transformers_renders(
        self, combo: Any, tokenised_chat: Callable[..., Any]
    ) -> None:
        processor, reference, norm = combo
        image = noise_image(300, 200, seed=1000)
        content = [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]
        messages = [{"role": "user", "content": content}]
        out = processor.process_chat(messages)
        hf = tokenised_chat(reference, messages, sanitize_control_tokens=True)
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm)

    def test_a_chat_of_several_images_tiles_each_as_if_it_were_alone(self, combo: Any) -> None:
        # transformers' apply_chat_template hands a conversation's images over as one nested
        # list, and LLaVA-OneVision then processes them in its multi-image mode (no tiles,
        # padded to a square): an image's outputs would depend on the others in its request.
        # mmproc's items may not, so each image gets what transformers gives it alone (a flat
        # list of images, as its processor call takes them, and as vLLM does).
        processor, reference, norm = combo
        images = [noise_image(300, 200, seed=1010), noise_image(120, 300, seed=1011)]
        content = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": "?"}]
        out = processor.process_chat([{"role": "user", "content": content}])
        prompt = reference.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        hf = call_hf_processor(reference, prompt, {"image": images})
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm)
        nested = reference(text=[prompt], images=[images], return_tensors="pt")
        assert nested["input_ids"].shape != hf["input_ids"].shape  # the mode mmproc leaves out


class TestNextIdentity(LlavaIdentity):
    image_processor_classes: ClassVar[dict[str, type]] = {
        "pil": LlavaNextImageProcessorPil,
        "torchvision": LlavaNextImageProcessor,
    }
    settings: ClassVar[dict[str, Any]] = {
        "image_mean": (0.48145466, 0.4578275, 0.40821073),
        "image_std": (0.26862954, 0.26130258, 0.27577711),
        "resample": int(Image.Resampling.BICUBIC),
        "image_grid_pinpoints": NEXT_PINPOINTS,
        "do_center_crop": True,
    }
    tokenizer_text = f"[INST] {IMAGE}\ndescribe the picture, please [/INST]"
    write_folder = staticmethod(partial(write_llava_folder, variant="next"))
    tile = 336
    pinpoints = NEXT_PINPOINTS

    def test_a_chat_is_what_transformers_renders_with_the_bos_the_tokenizer_adds(
        self, combo: Any, tokenised_chat: Callable[..., Any]
    ) -> None:
        # The Llama-style templates write no BOS: transformers' apply_chat_template lets the
        # tokenizer add it, and so does process_chat (unless told add_special_tokens=False).
        processor, reference, norm = combo
        images = [noise_image(500, 300, seed=1020), noise_image(90, 700, seed=1021)]
        content = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": "?"}]
        messages = [{"role": "user", "content": content}]
        out = processor.process_chat(messages)
        prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        hf = call_hf_processor(reference, prompt, {"image": images})
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm)
        theirs = tokenised_chat(reference, messages)["input_ids"][0].tolist()
        assert theirs == out.prompt_token_ids
        assert out.prompt_token_ids[0] == reference.tokenizer.bos_token_id
        bare = processor.process_chat(messages, add_special_tokens=False)
        assert bare.prompt_token_ids == out.prompt_token_ids[1:]


class TestNextVideoIdentity(VideoChecks, TestNextIdentity):
    tokenizer_text = f"USER: {VIDEO}\n{IMAGE}\ndescribe the picture, please ASSISTANT:"
    single_tokens = (IMAGE, VIDEO)
    write_folder = staticmethod(partial(write_llava_folder, variant="next_video"))

    def video_tokens(self, frames: int) -> int:
        return frames * 24 * 24 // 4  # 24 x 24 features pooled 2 x 2 a frame

    def layout_request(self) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
        image, video = noise_image(70, 35, "LA", seed=9000), noise_video(2, 40, 30, seed=9001)
        content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare"}]
        return [{"role": "user", "content": content}], {"image": [image], "video": [video]}
