"""Gemma 4 through mmproc equals transformers' ``Gemma4Processor`` called directly.

The demo folder carries the settings of transformers' Gemma 4 processor classes: images of up to
280 soft tokens (patch 16, pooling 3, ``max_soft_tokens`` one of 70, 140, 280, 560, 1120 per
request), videos of 32 frames of 70 each stamped with its ``mm:ss`` time, audio of one token per
40 ms up to 750 (30 s). The reference is built without the plugin and called as a user would, with
the frames mmproc sampled and their metadata for videos.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.inputs import parse_mm_data
from mmproc.plugin import (
    ConfigurationError,
    MediaItemError,
    VideoItem,
    VideoMetadata,
    hf_video_kwargs,
)
from mmproc.testing import call_hf_processor, noise_image, noise_video
from mmproc.testing.samples import encode_video, numbered_frames

IMAGE, VIDEO, AUDIO = "<|image|>", "<|video|>", "<|audio|>"
FAMILY = "gemma4"
TURN = "<|turn>user\n{}<turn|>\n<|turn>model\n"


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """75 s of 64 x 48 H.264 at 2 fps in an mp4: its sampled frames run past a minute."""
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    path.write_bytes(encode_video(numbered_frames(150), fps=2))
    return path


def metadata_of(frames: np.ndarray, fps: float) -> VideoMetadata:
    """mmproc's metadata of ``frames`` at ``fps``, every frame sampled."""
    count, height, width = frames.shape[:3]
    return VideoMetadata(
        fps=fps,
        duration_s=count / fps,
        total_frames=count,
        frame_indices=tuple(range(count)),
        timestamps_s=tuple(i / fps for i in range(count)),
        width=width,
        height=height,
    )


def frames_metadata(frames: np.ndarray, fps: float) -> Any:
    """transformers' metadata of ``frames`` at ``fps``, every frame sampled."""
    from transformers.video_utils import VideoMetadata as HFVideoMetadata

    count, height, width = frames.shape[:3]
    return HFVideoMetadata(
        total_num_frames=count,
        fps=fps,
        width=width,
        height=height,
        duration=count / fps,
        frames_indices=list(range(count)),
    )


# --- images ------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [70, 140, 280, 560, 1120])
def test_an_images_token_count_follows_its_size_and_the_requests_max_soft_tokens(
    gemma: Any, combo: Any, budget: int
) -> None:
    processor, reference, norm = combo
    prompt = TURN.format(f"\n\n{IMAGE}\n\nWhat is it?")
    counts = []
    for seed, size in enumerate([(1, 1), (640, 480), (3, 1000), (1000, 3), (901, 299)]):
        image = noise_image(*size, mode="RGBA" if seed % 2 else "RGB", seed=700 + seed)
        kwargs = {} if budget == 280 else {"max_soft_tokens": budget}
        out = processor.process(prompt, {"image": [image]}, hf_kwargs=kwargs)
        hf = call_hf_processor(reference, prompt, {"image": [image]}, **kwargs)
        context = f"{size}, max_soft_tokens {budget}"
        gemma.assert_like_hf(
            out, hf, "gemma4", reference.tokenizer, normalised=norm, context=context
        )
        (feature,) = out.features
        count = feature.placeholder.embed_count
        positions = feature.data["image_position_ids"]
        # Padded to the budget's patches; the padding's position ids are -1, its pixels 0.
        assert positions.shape == (budget * 9, 2) and count <= budget
        real = int((positions[:, 0] >= 0).sum())
        assert real == count * 9 and bool((positions[real:] == -1).all())
        assert not feature.data["pixel_values"][real:].any()
        counts.append(count)
    assert len(set(counts)) > 1


def test_a_max_soft_tokens_transformers_refuses_fails_the_request_and_the_next_is_served(
    processors: Any,
) -> None:
    processor = processors[("torchvision", True)]
    image = noise_image(64, 64, seed=710)
    with pytest.raises(mmproc.MmprocError, match="max_soft_tokens"):
        processor.process(IMAGE, {"image": [image]}, hf_kwargs={"max_soft_tokens": 100})
    # 64 x 64 is resized to fill the default budget of 280 (here 16 x 16 patches of 16 pixels
    # over 3 x 3: 256 soft tokens).
    assert processor.process(IMAGE, {"image": [image]}).features[0].placeholder.embed_count == 256


def test_a_request_may_not_change_the_patch_or_pooling_size(processors: Any) -> None:
    processor = processors[("pil", True)]
    for kwargs in ({"pooling_kernel_size": 2}, {"patch_size": 14}):
        with pytest.raises(ConfigurationError, match="cannot change per request"):
            processor.process(IMAGE, {"image": [noise_image(64, 64, seed=711)]}, hf_kwargs=kwargs)


# --- video -------------------------------------------------------------------------------------


def test_a_video_file_is_sampled_and_each_frame_stamped_with_its_time(
    gemma: Any, processors: Any, references: Any, clip: Path
) -> None:
    processor, reference = processors[("torchvision", True)], references["torchvision"]
    prompt = TURN.format(f"\n\n{VIDEO}\n\nWhat happens?")
    out = processor.process(prompt, {"video": [str(clip)]})
    (decoded,) = parse_mm_data({"video": [str(clip)]}, media=processor.media)["video"]
    assert decoded.num_frames == 32 and decoded.metadata.fps == pytest.approx(2.0)
    hf = reference(text=[prompt], **hf_video_kwargs([decoded]), return_tensors="pt")
    gemma.assert_like_hf(out, hf, "gemma4", reference.tokenizer, normalised=True)
    text = reference.tokenizer.decode(out.prompt_token_ids)
    stamps = [
        f"{int(i / 2) // 60:02d}:{int(i / 2) % 60:02d}" for i in decoded.metadata.frame_indices
    ]
    assert stamps[0] == "00:00" and stamps[-1].startswith("01:")
    assert text.count("<|image>") == 32
    for stamp in stamps:
        assert f"{stamp} <|image>" in text
    # The first stamp is text next to the prompt's "\n\n"; the range starts at its <|image>.
    r = out.features[0].placeholder
    assert reference.tokenizer.decode(out.prompt_token_ids[r.offset : r.offset + 1]) == "<|image>"
    per_frame = int((out.features[0].data["video_position_ids"][0][:, 0] >= 0).sum()) // 9
    assert per_frame <= 70 and r.embed_count == 32 * per_frame


def test_a_video_given_with_its_metadata_gets_its_times(
    gemma: Any, processors: Any, references: Any
) -> None:
    processor, reference = processors[("pil", False)], references["pil"]
    frames = noise_video(5, 96, 64, seed=720)
    metadata = VideoMetadata(
        fps=0.5,
        duration_s=130.0,
        total_frames=65,
        frame_indices=(0, 16, 32, 48, 64),
        timestamps_s=(0.0, 32.0, 64.0, 96.0, 128.0),
        width=96,
        height=64,
    )
    video = VideoItem(frames, metadata)
    out = processor.process(VIDEO, {"video": [video]})
    hf = reference(text=[VIDEO], **hf_video_kwargs([video]), return_tensors="pt")
    gemma.assert_like_hf(out, hf, "gemma4", reference.tokenizer, normalised=False)
    text = reference.tokenizer.decode(out.prompt_token_ids)
    assert [s for s in ("00:00", "00:32", "01:04", "01:36", "02:08") if s in text] == [
        "00:00",
        "00:32",
        "01:04",
        "01:36",
        "02:08",
    ]


def test_bare_frames_are_refused_without_their_rate_and_taken_with_it(
    gemma: Any, folder: Path, references: Any
) -> None:
    frames = noise_video(3, 64, 48, seed=730)
    timed = VideoItem(frames, metadata_of(frames, 2.0))
    with mmproc.get_processor(folder) as processor:
        with pytest.raises(MediaItemError, match=r"video item 1: .*video_fps") as info:
            processor.process(f"{VIDEO}{VIDEO}", {"video": [timed, frames[:2]]})
        assert (info.value.modality, info.value.index) == ("video", 1)
        assert processor.process(IMAGE, {"image": [noise_image(32, 32)]}).features
    reference = references["torchvision"]
    with mmproc.get_processor(folder, video_fps=1.0) as processor:
        out = processor.process(VIDEO, {"video": [frames]})
    hf = reference(
        text=[VIDEO],
        videos=[frames],
        video_metadata=[frames_metadata(frames, 1.0)],
        do_sample_frames=False,
        return_tensors="pt",
    )
    gemma.assert_like_hf(out, hf, "gemma4", reference.tokenizer, normalised=True)
    assert "00:02 <|image>" in reference.tokenizer.decode(out.prompt_token_ids)


# --- audio -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [0.01, 0.1, 0.5, 1.0, 7.77, 29.98, 30.0])
def test_a_clips_token_count_is_one_per_40_ms_as_transformers_counts(
    gemma: Any, processors: Any, references: Any, seconds: float
) -> None:
    prompt = TURN.format(f"\n\n{AUDIO}\n\nTranscribe.")
    out = gemma.one_clip(processors, references, FAMILY, prompt, seconds, int(seconds * 10))
    count = out.features[0].placeholder.embed_count
    # One token per 4 mel frames (20 ms every 10 ms; two stride-2 convolutions): about one per
    # 40 ms, ceil(ms / 40) or one fewer (a frame needs its whole 20 ms); none under 20 ms.
    samples = round(seconds * 16000)
    frames = (samples - 161) // 160 + 1 if samples > 160 else 0
    assert count == math.ceil(frames / 4)
    assert math.ceil(seconds * 1000 / 40) - count in (0, 1)


def test_a_clip_over_30_seconds_is_750_tokens_of_its_first_30_and_the_log_says_so(
    gemma: Any, processors: Any, references: Any, caplog: pytest.LogCaptureFixture
) -> None:
    processor, reference = processors[("pil", True)], references["pil"]
    out = gemma.long_clip(processor, reference, FAMILY, AUDIO, 33.0, caplog)
    assert out.features[0].placeholder.embed_count == 750


def test_several_clips_are_padded_as_transformers_pads_them_and_split_by_their_mask(
    gemma: Any, processors: Any, references: Any
) -> None:
    processor, reference = processors[("torchvision", False)], references["torchvision"]
    clips = [(gemma.tone(s, seed=i), 16000) for i, s in enumerate((2.0, 0.33, 4.7, 0.04))]
    prompt = f"{AUDIO}{AUDIO} and {AUDIO}\n{AUDIO}"
    out = processor.process(prompt, {"audio": clips})
    hf = call_hf_processor(reference, prompt, {"audio": clips})  # one batch: masked frames
    gemma.assert_like_hf(out, hf, "gemma4", reference.tokenizer)
    for feature, (waveform, _) in zip(out.features, clips, strict=True):
        alone = call_hf_processor(reference, AUDIO, {"audio": [(waveform, 16000)]})
        assert torch.equal(feature.data["input_features"], alone["input_features"][0])


# --- together ----------------------------------------------------------------------------------


def test_images_videos_and_clips_together_match_on_every_path(
    gemma: Any, folder: Path, combo: Any, combo_key: tuple[str, bool]
) -> None:
    _, reference, norm = combo
    images = [noise_image(500, 300, seed=740), noise_image(20, 200, "L", seed=741)]
    videos = [noise_video(3, 80, 60, seed=742), noise_video(2, 48, 96, seed=743)]
    clips = [(gemma.tone(1.1, seed=744), 16000), (gemma.tone(0.6, hz=800, seed=745), 16000)]
    body = f"\n\n{IMAGE}\n\n{VIDEO}{AUDIO} and {IMAGE}{AUDIO}\n\n{VIDEO}\n\nWhat now?"
    prompt = TURN.format(body)
    mm_data = {"image": images, "video": videos, "audio": clips}
    metadata = [frames_metadata(v, 2.0) for v in videos]
    with (
        mmproc.get_processor(
            folder, backend=combo_key[0], device_normalize=norm, video_fps=2.0
        ) as ours,
        mmproc.get_processor(
            folder,
            backend=combo_key[0],
            device_normalize=norm,
            video_fps=2.0,
            hf_prompt_expansion=True,
        ) as expanding,
    ):
        out = ours.process(prompt, mm_data)
        ids = ours.process(reference.tokenizer(prompt)["input_ids"], mm_data)
        expanded = expanding.process(prompt, mm_data)
    hf = call_hf_processor(
        reference, prompt, mm_data, video_metadata=metadata, do_sample_frames=False
    )
    gemma.assert_like_hf(out, hf, "gemma4", reference.tokenizer)
    assert all((f.norm is not None) is (norm and f.modality != "audio") for f in out.features)
    types = out.prompt_outputs["mm_token_type_ids"].tolist()
    assert types == hf["mm_token_type_ids"][0].tolist() and set(types) == {0, 1, 2, 3}
    for other in (ids, expanded):
        assert other.prompt_token_ids == out.prompt_token_ids
        assert [f.placeholder for f in other.features] == [f.placeholder for f in out.features]


def test_the_chat_path_gives_what_apply_chat_template_gives(gemma: Any, processors: Any) -> None:
    processor = processors[("torchvision", False)]
    image = noise_image(300, 200, seed=750)
    url = gemma.wav_url(gemma.tone(1.7, seed=751), 16000)
    ours = [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": gemma.png_url(image)}},
                {"type": "audio_url", "audio_url": {"url": url}},
                {"type": "text", "text": "Same thing?"},
            ],
        },
    ]
    out = gemma.chat_like_hf(processor, FAMILY, ours)
    assert [f.modality for f in out.features] == ["image", "audio"]
