"""mmproc's GLM-4.1V / GLM-4.5V / GLM-4.6V output equals transformers' processors called
directly.

The reference is built without the plugin: ``AutoProcessor`` on the demo folder with the chosen
backend's image processor, called with ``text=[prompt], images=..., return_tensors="pt"`` and,
for videos, their frames and metadata (``hf_video_kwargs``, as a user passes them). What must
match: prompt ids, per-item patches and grids, placeholder ranges (only ``<|image|>`` embeds),
and the prompt's ``mm_token_type_ids``; with device normalisation ``FusedInputNorm`` of the
uint8 patches within 1e-6 of transformers' floats, without it equal. The matrix shared with
other two-backend grid models is the kit's (``mmproc.testing.identity.ImageIdentityMatrix``);
GLM's own checks follow it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import mmproc
import pytest
import torch
from mmproc.plugin import BatchedField, FieldSpec, FlatField, hf_video_kwargs
from mmproc.testing import call_hf_processor, noise_image, noise_video
from mmproc.testing.identity import BACKENDS, GRID_FIELDS, ImageIdentityMatrix
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_glm4v.demo import write_glm_folder
from PIL import Image
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm46v.image_processing_glm46v import Glm46VImageProcessor
from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil

IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"


class TestGlm41VIdentity(ImageIdentityMatrix):
    image = IMAGE
    # A video's embeddings land on <|image|> tokens too (mm_token_type_ids tell them apart).
    placeholder_tokens: ClassVar[dict[str, str]] = {"image": "<|image|>", "video": "<|image|>"}
    image_processor_classes: ClassVar[dict[str, type]] = {
        "pil": Glm4vImageProcessorPil,
        "torchvision": Glm4vImageProcessor,
    }
    fields: ClassVar[dict[str, FieldSpec]] = {
        **GRID_FIELDS,
        "pixel_values_videos": FlatField.from_grid("video", "video_grid_thw"),
        "video_grid_thw": BatchedField("video"),
    }
    settings: ClassVar[dict[str, Any]] = {
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 12544,
        "max_pixels": 9633792,
        "image_mean": (0.48145466, 0.4578275, 0.40821073),
        "image_std": (0.26862954, 0.26130258, 0.27577711),
        "resample": int(Image.Resampling.BICUBIC),
    }
    tokenizer_text = f"[gMASK]<sop><|user|>\n{IMAGE}describe the picture, please<|assistant|>"
    single_tokens = ("<|begin_of_image|>", "<|image|>", "<|video|>", "<|end_of_video|>")
    write_folder = staticmethod(write_glm_folder)

    @staticmethod
    def stamp(seconds: float) -> str:
        """How the processor writes a frame pair's time: ``Glm4vProcessor``, whole seconds."""
        return str(int(seconds))

    @pytest.fixture(autouse=True)
    def _videos(self, video_with_metadata: Callable[..., Any]) -> None:
        self.with_metadata = video_with_metadata

    def check(self, combo: Any, prompt: str, mm_data: dict[str, list[Any]]) -> Any:
        """One request through mmproc and through transformers (videos with their metadata),
        which must agree, ``mm_token_type_ids`` included."""
        processor, reference, norm = combo
        out = processor.process(prompt, mm_data)
        videos = mm_data.get("video", [])
        call = {"images": mm_data["image"]} if mm_data.get("image") else {}
        if videos:
            call.update(hf_video_kwargs(videos))
        hf = reference(text=[prompt], return_tensors="pt", **call)
        assert "mm_token_type_ids" in hf and "mm_token_type_ids" in out.prompt_outputs
        self.assert_identical(out, hf, reference.tokenizer, normalised=norm, context=prompt[:40])
        return out, hf

    def test_videos_of_several_lengths_keep_a_timestamp_per_frame_pair(self, combo: Any) -> None:
        tokenizer = combo[1].tokenizer
        for count in (2, 3, 5, 8):
            video = self.with_metadata(noise_video(count, 64, 48, seed=100 + count), fps=1.5)
            out, _ = self.check(combo, f"<|user|>\n{VIDEO}What happens?", {"video": [video]})
            text = tokenizer.decode(out.prompt_token_ids).replace("<|image|>", "")
            # A frame pair each (an odd count padded with its last frame), stamped with its
            # first frame's time: frames 0, 2, 4, ... at 1.5 fps.
            stamps = [self.stamp(i / 1.5) for i in range(0, count + count % 2, 2)]
            blocks = "".join(f"<|begin_of_image|><|end_of_image|>{s}" for s in stamps)
            assert f"<|begin_of_video|>{blocks}<|end_of_video|>" in text

    def test_images_and_videos_in_one_request_are_typed_apart(self, combo: Any) -> None:
        images = [noise_image(640, 480, seed=200), noise_image(33, 90, "P", seed=201)]
        videos = [
            self.with_metadata(noise_video(4, 56, 56, seed=202), fps=2.0, first=6),
            self.with_metadata(noise_video(3, 90, 30, seed=203), fps=30.0),
        ]
        prompt = f"{IMAGE} then {VIDEO} and {IMAGE}{VIDEO} compare"
        out, _ = self.check(combo, prompt, {"image": images, "video": videos})
        types = torch.as_tensor(out.prompt_outputs["mm_token_type_ids"])
        for feature in out.features:
            r = feature.placeholder
            embedded = types[r.offset : r.end][torch.tensor(r.embed_mask())]
            assert set(embedded.tolist()) == {1 if feature.modality == "image" else 2}

    def test_a_video_without_metadata_or_of_one_frame_is_refused_by_its_index(
        self, combo: Any
    ) -> None:
        processor, reference = combo[0], combo[1]
        good = self.with_metadata(noise_video(2, 40, 30, seed=300))
        with pytest.raises(mmproc.MediaItemError, match=r"video item 1: .*no metadata"):
            processor.process(VIDEO * 2, {"video": [good, noise_video(2, 40, 30, seed=301)]})
        still = self.with_metadata(noise_video(1, 40, 30, seed=302))
        with pytest.raises(mmproc.MediaItemError, match=r"video item 1: .*temporal_factor"):
            processor.process(VIDEO * 2, {"video": [good, still]})
        with pytest.raises(ValueError, match="temporal_factor"):  # transformers refuses it too
            reference(text=[VIDEO], **hf_video_kwargs([still]), return_tensors="pt")
        self.check(combo, f"{VIDEO} again", {"video": [good]})

    def test_an_mp4_is_stamped_with_its_sampled_frames_times(
        self, processors: Any, references: Any
    ) -> None:
        from mmproc.inputs import parse_mm_data

        processor, reference = processors[("torchvision", True)], references["torchvision"]
        mp4 = encode_video(numbered_frames(45), fps=10)  # 4.5 s at 10 fps
        (decoded,) = parse_mm_data({"video": [mp4]}, media=processor.media)["video"]
        assert decoded.metadata.frame_indices == (0, 5, 10, 15, 20, 25, 30, 35, 40)  # 2 fps
        prompt = f"<|user|>\n{VIDEO}What happens?<|assistant|>\n"
        expected, _ = self.check((processor, reference, True), prompt, {"video": [decoded]})
        from_file = processor.process(prompt, {"video": [mp4]})
        assert from_file.prompt_token_ids == expected.prompt_token_ids
        # Nine frames: padded to ten, five pairs, from source frames 0, 10, 20, 30, 40.
        text = reference.tokenizer.decode(from_file.prompt_token_ids).replace("<|image|>", "")
        blocks = "".join(f"<|begin_of_image|><|end_of_image|>{self.stamp(s)}" for s in range(5))
        assert f"<|begin_of_video|>{blocks}<|end_of_video|>" in text

    def test_a_chat_with_an_image_and_a_video_file_renders_and_matches(
        self, combo: Any, tmp_path: Path
    ) -> None:
        from mmproc.inputs import parse_mm_data

        processor, reference, _ = combo
        clip = tmp_path / "clip.mp4"
        clip.write_bytes(encode_video(numbered_frames(20), fps=10))
        image = noise_image(300, 200, seed=400)
        content = [
            {"type": "image", "image": image},
            {"type": "video", "video": str(clip)},
            {"type": "text", "text": "What changes?"},
        ]
        out = processor.process_chat([{"role": "user", "content": content}])
        prompt = reference.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        assert prompt.startswith(f"[gMASK]<sop><|user|>\n{IMAGE}{VIDEO}What changes?")
        (decoded,) = parse_mm_data({"video": [str(clip)]}, media=processor.media)["video"]
        again = self.check(combo, prompt, {"image": [image], "video": [decoded]})[0]
        assert out.prompt_token_ids == again.prompt_token_ids


class TestGlm46VIdentity(TestGlm41VIdentity):
    """GLM-4.6V: the same images, ``Glm46VProcessor``'s timestamps (``x.y seconds``)."""

    image_processor_classes: ClassVar[dict[str, type]] = {
        "pil": Glm46VImageProcessorPil,
        "torchvision": Glm46VImageProcessor,
    }
    write_folder = staticmethod(partial(write_glm_folder, release="4.6v"))

    @staticmethod
    def stamp(seconds: float) -> str:
        """``Glm46VProcessor``: tenths of a second, and the word."""
        return f"{seconds:.1f} seconds"


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_release_takes_its_token_ids_from_its_tokenizer(
    tmp_path: Path,
    backend: str,
    video_with_metadata: Callable[..., Any],
) -> None:
    from transformers import AutoProcessor

    ids = {}
    for release in ("4.1v", "4.5v"):
        folder = write_glm_folder(tmp_path / release, release)
        reference = AutoProcessor.from_pretrained(folder)
        video = video_with_metadata(noise_video(2, 56, 56, seed=600))
        prompt = f"{IMAGE}{VIDEO}"
        mm_data = {"image": [noise_image(90, 60, seed=601)], "video": [video]}
        with mmproc.get_processor(folder, backend=backend, device_normalize=False) as processor:
            out = processor.process(prompt, mm_data)
            ids[release] = processor.hf_processor.image_token_id
        hf = call_hf_processor(reference, prompt, mm_data)
        assert out.prompt_token_ids == hf["input_ids"][0].tolist()
    assert ids["4.5v"] == ids["4.1v"] + 20  # twenty more special tokens before <|image|>


@pytest.mark.parametrize(
    ("release", "architecture", "processor"),
    [
        ("4.1v", None, "Glm4vProcessor"),
        ("4.5v", None, "Glm4vProcessor"),
        ("4.6v", None, "Glm46VProcessor"),  # the MoE architecture with GLM-4.6V's processor
        ("4.6v", "Glm46VForConditionalGeneration", "Glm46VProcessor"),
    ],
)
def test_the_folders_processor_class_decides_the_processor(
    tmp_path: Path, release: str, architecture: str | None, processor: str
) -> None:
    folder = write_glm_folder(tmp_path / "glm", release, architecture=architecture)
    with mmproc.get_processor(folder, warm_up=False) as ours:
        assert type(ours.hf_processor).__name__ == processor
        assert ours.ctx.architecture == (architecture or ours.ctx.config["architectures"][0])
