"""Qwen3-VL and Qwen3.5 videos through the qwen_vl plugin, against transformers' own processor.

``Qwen3VLProcessor`` gives each pair of frames a ``<t seconds>`` (the pair's mean time from the
source's frame indices and fps, one decimal) before its ``<|vision_start|>`` pads
``<|vision_end|>``. mmproc must write the same tokens from the video's real metadata: a file's
(mmproc decodes and samples it), or the metadata a caller gives with frames; frames given without
any are timed at the model's own 2 fps (the plugin's documented default), never transformers'
assumed 24, and are never sampled again. The reference is transformers' processor built without
the plugin, called with the same frames, their metadata and ``do_sample_frames=False``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.inputs import parse_mm_data
from mmproc.plugin import BatchedField, FlatField, MediaItemError, VideoItem, VideoMetadata
from mmproc.testing import assert_matches_hf, call_hf_processor, noise_image, noise_video
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_qwen_vl.demo import QWEN3_VARIANTS
from PIL import Image

QWEN3 = tuple(QWEN3_VARIANTS)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
FIELDS = {
    "pixel_values": FlatField.from_grid("image", "image_grid_thw"),
    "image_grid_thw": BatchedField("image"),
    "pixel_values_videos": FlatField.from_grid("video", "video_grid_thw"),
    "video_grid_thw": BatchedField("video"),
}
# (frames, fps): a few seconds at common rates, one shorter than the 4 frames the model samples
# at the least, one long enough to be sampled sparsely.
CLIPS = [(90, 30), (55, 25), (60, 12), (10, 10), (200, 24)]


def metadata(indices: list[int], fps: float, width: int, height: int) -> VideoMetadata:
    """What a caller who sampled ``indices`` from a ``fps`` video tells mmproc."""
    total = max(indices) + 1
    return VideoMetadata(
        fps=fps,
        duration_s=total / fps,
        total_frames=total,
        frame_indices=tuple(indices),
        timestamps_s=tuple(i / fps for i in indices),
        width=width,
        height=height,
    )


def timed(frames: np.ndarray, indices: list[int], fps: float) -> VideoItem:
    return VideoItem(frames, metadata(indices, fps, frames.shape[2], frames.shape[1]))


def hf_call(reference: Any, prompt: str, images: list[Any], videos: list[VideoItem]) -> Any:
    """transformers' processor on the same request: each video's frames with its metadata."""
    return call_hf_processor(
        reference,
        prompt,
        {"image": images, "video": [video.frames for video in videos]},
        video_metadata=[video.metadata.to_transformers() for video in videos],  # type: ignore[union-attr]
        do_sample_frames=False,
    )


def assert_like(out: mmproc.ProcessedInputs, hf: Any, reference: Any, context: str = "") -> None:
    tokenizer = reference.tokenizer
    assert_matches_hf(
        out,
        hf,
        fields=FIELDS,
        placeholder_token_ids={
            "image": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            "video": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        },
        context=context,
    )
    assert "mm_token_type_ids" in hf and "mm_token_type_ids" in out.prompt_outputs


def timestamps(processor: mmproc.Processor, ids: list[int]) -> list[str]:
    """The ``<t seconds>`` texts of a prompt, in order."""
    return re.findall(r"<[\d.]+ seconds>", processor.hf_processor.tokenizer.decode(ids))


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], Path]:
    """H.264 mp4s of :data:`CLIPS`, 64x48, each frame showing its number."""
    root = tmp_path_factory.mktemp("clips")
    paths = {}
    for count, fps in CLIPS:
        path = root / f"{count}-at-{fps}.mp4"
        path.write_bytes(encode_video(numbered_frames(count), fps=fps))
        paths[(count, fps)] = path
    return paths


# --- where the times come from --------------------------------------------------------------------


@pytest.mark.parametrize("variant", QWEN3)
def test_a_file_is_timed_by_its_fps_and_the_indices_of_the_frames_mmproc_sampled(
    variant: str, qwen3_processor: Callable[..., Any], qwen3_reference: Any, clips: Any
) -> None:
    processor, reference = qwen3_processor(variant), qwen3_reference(variant)
    prompt = f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>"
    for (count, fps), path in clips.items():
        out = processor.process(prompt, {"video": [str(path)]})
        (decoded,) = parse_mm_data({"video": [str(path)]}, media=processor.media)["video"]
        assert decoded.metadata.fps == pytest.approx(fps) and decoded.metadata.total_frames == count
        assert_like(out, hf_call(reference, prompt, [], [decoded]), reference, f"{count}@{fps}")
        times = [
            (a / fps + b / fps) / 2 for a, b in zip(*[iter(decoded.metadata.frame_indices)] * 2)
        ]
        assert timestamps(processor, out.prompt_token_ids) == [f"<{t:.1f} seconds>" for t in times]
    # 3 s at 30 fps, sampled at the model's 2 fps: frames 0, 15, ..., 75, in pairs.
    out = processor.process(VIDEO, {"video": [str(clips[(90, 30)])]})
    assert timestamps(processor, out.prompt_token_ids) == [
        "<0.2 seconds>",  # (0 + 0.5) / 2 = 0.25, printed as Python prints it
        "<1.2 seconds>",
        "<2.2 seconds>",
    ]


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("variant", QWEN3)
def test_frames_with_metadata_keep_their_times_beside_an_image(
    variant: str, backend: str, qwen3_processor: Any, qwen3_reference: Any
) -> None:
    processor, reference = (
        qwen3_processor(variant, backend=backend),
        qwen3_reference(variant, backend),
    )
    videos = [
        timed(noise_video(5, 64, 48, seed=1), [0, 30, 60, 90, 120], 29.97),  # odd: pads the last
        timed(noise_video(2, 50, 70, seed=2), [7, 8], 25.0),
        timed(noise_video(8, 96, 40, seed=3), [0, 3, 6, 9, 12, 15, 18, 21], 12.0),
        timed(noise_video(3, 33, 47, seed=4), [100, 250, 400], 50.0),
    ]
    images = [noise_image(90, 60, seed=5), noise_image(17, 333, "RGBA", seed=6)]
    prompt = f"{IMAGE} then {VIDEO}{VIDEO} and {IMAGE}, {VIDEO} last {VIDEO}"
    out = processor.process(prompt, {"image": images, "video": videos})
    assert_like(out, hf_call(reference, prompt, images, videos), reference)
    assert timestamps(processor, out.prompt_token_ids)[:3] == [
        "<0.5 seconds>",  # (0 / 29.97 + 30 / 29.97) / 2
        "<2.5 seconds>",
        "<4.0 seconds>",  # the fifth frame, repeated
    ]


@pytest.mark.parametrize("variant", QWEN3)
def test_frames_without_metadata_are_kept_and_timed_at_the_models_2_fps(
    variant: str, qwen3_processor: Any, qwen3_reference: Any
) -> None:
    processor, reference = qwen3_processor(variant), qwen3_reference(variant)
    frames = noise_video(7, 64, 48, seed=10)
    out = processor.process(VIDEO, {"video": [frames]})
    # Seven frames are four temporal patches (the last frame repeated), at 0, 0.5, 1, ... s.
    assert out.features[0].data["video_grid_thw"].tolist() == [4, 4, 4]
    assert timestamps(processor, out.prompt_token_ids) == [
        "<0.2 seconds>",
        "<1.2 seconds>",
        "<2.2 seconds>",
        "<3.0 seconds>",
    ]
    default = timed(frames, list(range(7)), 2.0)
    assert_like(out, hf_call(reference, VIDEO, [], [default]), reference)
    # transformers alone would have assumed 24 fps and kept 4 of the 7 frames.
    alone = call_hf_processor(reference, VIDEO, {"video": [frames]})
    assert alone["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert timestamps(processor, alone["input_ids"][0].tolist()) == [
        "<0.0 seconds>",
        "<0.2 seconds>",
    ]
    # The processor mmproc hands out takes such frames as mmproc does.
    direct = call_hf_processor(processor.hf_processor, VIDEO, {"video": [frames]})
    assert direct["input_ids"][0].tolist() == out.prompt_token_ids


@pytest.mark.parametrize("variant", ["qwen3_vl", "qwen3_5"])
def test_a_one_frame_video_and_rgba_frames_are_taken_as_their_padded_and_converted_frames(
    variant: str, qwen3_processor: Any, qwen3_reference: Any
) -> None:
    processor, reference = qwen3_processor(variant), qwen3_reference(variant)
    still = timed(noise_video(1, 64, 48, seed=20), [42], 24.0)
    rgba = np.random.default_rng(21).integers(0, 256, (4, 48, 64, 4), dtype=np.uint8)
    for bad in (still.frames, rgba):  # what transformers refuses itself
        with pytest.raises(ValueError):
            call_hf_processor(reference, VIDEO, {"video": [bad]})
    out = processor.process(f"{VIDEO} {VIDEO}", {"video": [still, rgba]})
    # The still frame twice, at its own time; RGBA composited onto white as an RGBA image is.
    white = np.stack(
        [
            np.asarray(
                Image.alpha_composite(
                    Image.new("RGBA", (64, 48), (255, 255, 255, 255)), Image.fromarray(f, "RGBA")
                ).convert("RGB")
            )
            for f in rgba
        ]
    )
    as_given = [
        timed(np.concatenate([still.frames, still.frames]), [42, 42], 24.0),
        timed(white, [0, 1, 2, 3], 2.0),
    ]
    assert_like(out, hf_call(reference, f"{VIDEO} {VIDEO}", [], as_given), reference)
    assert timestamps(processor, out.prompt_token_ids) == [
        "<1.8 seconds>",  # frame 42 at 24 fps
        "<0.2 seconds>",
        "<1.2 seconds>",
    ]


# --- what the prompt holds ------------------------------------------------------------------------


def test_only_the_pads_of_a_video_are_its_embeddings(qwen3_processor: Any) -> None:
    processor = qwen3_processor("qwen3_vl")
    hf = processor.hf_processor
    video = timed(noise_video(4, 64, 64, seed=30), [0, 5, 10, 15], 10.0)
    out = processor.process(f"a{VIDEO}b", {"video": [video]})
    (feature,) = out.features
    r = feature.placeholder
    span = out.prompt_token_ids[r.offset : r.offset + r.length]
    pads = [token == hf.video_token_id for token in span]
    assert list(r.embed_mask()) == pads and sum(pads) == 2 * 2 * 2  # 2 patches of 2x2 merged
    text = hf.tokenizer.decode(span)
    assert text == (
        "<0.2 seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
        "<1.2 seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    )
    # The start and end the prompt had around the video are gone (each block has its own):
    # the prompt's own text is next to the range on both sides.
    assert hf.tokenizer.decode(out.prompt_token_ids[: r.offset]).endswith("a")
    assert hf.tokenizer.decode(out.prompt_token_ids[r.offset + r.length :]).startswith("b")
    types = out.prompt_outputs["mm_token_type_ids"].tolist()
    assert [i for i, t in enumerate(types) if t == 2] == [
        r.offset + i for i, embeds in enumerate(r.embed_mask()) if embeds
    ]


def test_a_video_pad_with_and_one_without_its_start_and_end_are_expanded_as_transformers_does(
    qwen3_processor: Any, qwen3_reference: Any
) -> None:
    processor, reference = qwen3_processor("qwen3_vl"), qwen3_reference("qwen3_vl")
    videos = [
        timed(noise_video(4, 64, 64, seed=31), [0, 5, 10, 15], 10.0),
        timed(noise_video(2, 64, 48, seed=32), [0, 3], 6.0),
    ]
    # The bare pad comes first, so a bare match cannot be mistaken for the wrapped one's.
    prompt = f"x<|video_pad|>y{VIDEO}z"
    out = processor.process(prompt, {"video": videos})
    assert_like(out, hf_call(reference, prompt, [], videos), reference)
    tokenizer = processor.hf_processor.tokenizer
    first, second = (feature.placeholder for feature in out.features)
    assert (
        tokenizer.decode(out.prompt_token_ids[first.offset + first.length : second.offset]) == "y"
    )


def test_a_video_s_timestamps_are_cached_with_it_and_other_metadata_is_another_item(
    qwen3_processor: Any, qwen3_reference: Any
) -> None:
    processor, reference = qwen3_processor("qwen3_5"), qwen3_reference("qwen3_5")
    frames = noise_video(4, 64, 48, seed=40)
    first = processor.process(VIDEO, {"video": [timed(frames, [0, 1, 2, 3], 4.0)]})
    hits = processor.cache.stats().hits
    again = processor.process(f"x {VIDEO}", {"video": [timed(frames, [0, 1, 2, 3], 4.0)]})
    assert processor.cache.stats().hits == hits + 1
    assert again.prompt_token_ids[2:] == first.prompt_token_ids
    slower = timed(frames, [0, 1, 2, 3], 1.0)
    other = processor.process(VIDEO, {"video": [slower]})
    assert processor.cache.stats().hits == hits + 1
    assert timestamps(processor, first.prompt_token_ids) == ["<0.1 seconds>", "<0.6 seconds>"]
    assert timestamps(processor, other.prompt_token_ids) == ["<0.5 seconds>", "<2.5 seconds>"]
    assert_like(other, hf_call(reference, VIDEO, [], [slower]), reference)


@pytest.mark.parametrize("variant", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_the_hf_expansion_cached_and_token_id_paths_agree_on_timed_videos(
    variant: str, qwen3_processor: Any
) -> None:
    cached = qwen3_processor(variant)
    expanding = qwen3_processor(variant, hf_prompt_expansion=True)
    videos = [
        timed(noise_video(3, 64, 48, seed=50), [3, 9, 15], 6.0),
        timed(noise_video(6, 40, 72, seed=51), [0, 10, 20, 30, 40, 50], 29.0),
    ]
    image = noise_image(64, 64, seed=52)
    prompt = f"<|im_start|>user\n{VIDEO}{IMAGE} and {VIDEO}?<|im_end|>"
    mm = {"image": [image], "video": videos}
    ids = cached.hf_processor.tokenizer(prompt)["input_ids"]
    results = [expanding.process(prompt, mm), cached.process(prompt, mm), cached.process(ids, mm)]
    for out in results[1:]:
        assert out.prompt_token_ids == results[0].prompt_token_ids
        assert [f.placeholder for f in out.features] == [f.placeholder for f in results[0].features]
        assert torch.equal(
            out.prompt_outputs["mm_token_type_ids"], results[0].prompt_outputs["mm_token_type_ids"]
        )


# --- what is refused ------------------------------------------------------------------------------


def test_metadata_without_a_usable_fps_is_refused_naming_the_item(qwen3_processor: Any) -> None:
    processor = qwen3_processor("qwen3_vl")
    good = timed(noise_video(2, 64, 48, seed=60), [0, 1], 2.0)
    for fps in (0.0, -3.0, float("nan")):
        broken = VideoItem(good.frames, dataclasses.replace(good.metadata, fps=fps))  # type: ignore[arg-type]
        with pytest.raises(MediaItemError, match="fps") as caught:
            processor.process(VIDEO * 2, {"video": [good, broken]})
        assert (caught.value.modality, caught.value.index) == ("video", 1)
    assert processor.process(VIDEO, {"video": [good]}).features  # still serving


def test_asking_transformers_to_sample_given_frames_again_is_refused(
    qwen3_processor: Any,
) -> None:
    processor = qwen3_processor("qwen3_5")
    frames = noise_video(6, 64, 48, seed=70)
    with pytest.raises(mmproc.MmprocError, match="do_sample_frames"):
        processor.process(VIDEO, {"video": [frames]}, hf_kwargs={"do_sample_frames": True})
    assert processor.process(VIDEO, {"video": [frames]}).features[0].data[
        "video_grid_thw"
    ].tolist() == [3, 4, 4]


# --- many more, seeded ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", QWEN3)
def test_random_videos_and_images_match_transformers(
    variant: str, qwen3_processor: Any, qwen3_reference: Any
) -> None:
    rng = np.random.default_rng(sum(map(ord, variant)))
    for backend in ("pil", "torchvision"):
        processor = qwen3_processor(variant, backend=backend)
        reference = qwen3_reference(variant, backend)
        for case in range(6):
            videos = []
            for _ in range(int(rng.integers(1, 3))):
                count = int(rng.integers(1, 10))
                fps = float(rng.choice([1.0, 2.0, 7.5, 23.976, 30.0, 60.0]))
                indices = np.sort(rng.choice(400, count, replace=False)).tolist()
                width, height = (int(n) for n in rng.integers(20, 140, 2))
                videos.append(timed(noise_video(count, width, height, seed=case), indices, fps))
            images = [noise_image(*(int(n) for n in rng.integers(1, 300, 2)), seed=case)]
            prompt = f"{VIDEO}{IMAGE}" + f" {VIDEO}" * (len(videos) - 1)
            out = processor.process(prompt, {"image": images, "video": videos})
            # One-frame videos: transformers gets them padded, as mmproc gives them.
            given = [
                v
                if v.num_frames > 1
                else timed(
                    np.repeat(v.frames, 2, 0), [v.metadata.frame_indices[0]] * 2, v.metadata.fps
                )  # type: ignore[union-attr]
                for v in videos
            ]
            hf = hf_call(reference, prompt, images, given)
            assert_like(out, hf, reference, f"{backend} case {case}")
