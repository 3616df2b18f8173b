"""Video files through the qwen_vl plugin: an mp4 decoded, sampled at Qwen2-VL's 2 fps (an even
frame count), processed like transformers processes the same frames, the metadata reaching
Qwen2.5-VL's ``second_per_grid_ts``, and the same video as a path, bytes and a data: URL sharing
one cache entry."""

from __future__ import annotations

import base64
from pathlib import Path

import mmproc
import pytest
import torch
from mmproc.inputs import parse_mm_data
from mmproc.media import MediaOptions
from mmproc.plugin import MediaItemError, hf_video_kwargs
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_qwen_vl.demo import write_qwen2_vl_folder

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s of 64x48 H.264 at 30 fps in an mp4."""
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    path.write_bytes(encode_video(numbered_frames(90), fps=30))
    return path


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_an_mp4_runs_end_to_end_as_transformers_processes_its_frames(
    tmp_path: Path, clip: Path, variant: str
) -> None:
    folder = write_qwen2_vl_folder(tmp_path / variant, variant=variant)
    prompt = f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>"
    with mmproc.get_processor(folder, device_normalize=False) as processor:
        out = processor.process(prompt, {"video": [str(clip)]})
        (decoded,) = parse_mm_data({"video": [str(clip)]}, media=processor.media)["video"]
        reference = processor.hf_processor(
            text=[prompt], **hf_video_kwargs([decoded]), return_tensors="pt"
        )
    # 2 fps over 3 s: 6 frames, an even count; frames are 1 / 2 s apart.
    assert decoded.metadata is not None
    assert decoded.frames.shape[0] == 6 and decoded.metadata.fps == 30
    assert list(decoded.metadata.timestamps_s) == pytest.approx([0, 0.5, 1, 1.5, 2, 2.5])
    assert out.prompt_token_ids == reference["input_ids"][0].tolist()
    (feature,) = out.features
    assert torch.equal(feature.data["video_grid_thw"], reference["video_grid_thw"][0])
    assert torch.equal(feature.data["pixel_values_videos"], reference["pixel_values_videos"])
    if variant == "qwen2_5_vl":
        # temporal patch 2 / sampled 2 fps: each grid step is one second of video
        assert float(feature.data["second_per_grid_ts"]) == pytest.approx(1.0)


def test_a_video_as_a_path_bytes_and_a_data_url_is_one_cache_entry(
    tmp_path: Path, clip: Path
) -> None:
    folder = write_qwen2_vl_folder(tmp_path / "qwen")
    data = clip.read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    with mmproc.get_processor(folder) as processor:
        hashes = {
            processor.process(VIDEO, {"video": [form]}).features[0].hash
            for form in (str(clip), data, url)
        }
        stats = processor.cache.stats()
    assert len(hashes) == 1
    assert (stats.misses, stats.hits) == (1, 2)


def test_a_server_confines_paths_and_the_processor_keeps_serving(
    tmp_path: Path, clip: Path
) -> None:
    folder = write_qwen2_vl_folder(tmp_path / "qwen")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inside = allowed / "clip.mp4"
    inside.write_bytes(clip.read_bytes())
    (tmp_path / "outside.mp4").write_bytes(clip.read_bytes())
    (allowed / "link.mp4").symlink_to(tmp_path / "outside.mp4")
    with mmproc.get_processor(folder, allowed_media_paths=[allowed]) as processor:
        assert processor.media == MediaOptions(
            video=processor.media.video, allowed_paths=(allowed.resolve(),)
        )
        with pytest.raises(MediaItemError, match=r"video item 0: .*outside the allowed"):
            processor.process(VIDEO, {"video": [str(clip)]})
        for escaping in (allowed / ".." / "outside.mp4", allowed / "link.mp4"):
            with pytest.raises(MediaItemError, match=r"video item 0: .*outside the allowed"):
                processor.process(VIDEO, {"video": [str(escaping)]})
        assert processor.process(VIDEO, {"video": [str(inside)]}).features
