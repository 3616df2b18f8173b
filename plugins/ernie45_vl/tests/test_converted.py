"""The converted layout (transformers' ``Ernie4_5_VLMoeProcessor``): what mmproc gives equals
that processor, built by transformers itself from the folder and called directly, for images of
every size and mode on both backends, videos of several lengths and from files, and the prompt's
per-token outputs; the folder's settings are read as transformers reads them."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mmproc
import numpy as np
import pytest
import torch
from mmproc.inputs import parse_mm_data
from mmproc.plugin import ConfigurationError, MediaItemError, ProcessorLoadError
from mmproc.testing import assert_matches_hf, noise_image
from mmproc.testing.samples import encode_video, numbered_frames
from mmproc_ernie45_vl.demo import write_converted_folder
from mmproc_ernie45_vl.model import CONVERTED_IMAGE_PLACEHOLDER, CONVERTED_VIDEO_PLACEHOLDER
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, AutoVideoProcessor
from transformers.models.ernie4_5_vl_moe.processing_ernie4_5_vl_moe import Ernie4_5_VLMoeProcessor

IMAGE, VIDEO = CONVERTED_IMAGE_PLACEHOLDER, CONVERTED_VIDEO_PLACEHOLDER
# (width, height): a pixel (grown to min_pixels), thin, exactly 200:1, odd, wide, on the 28-pixel
# grid.
SIZES = [(1, 1), (12, 900), (1000, 5), (57, 113), (333, 77), (56, 84)]
MODES = ["RGB", "L", "RGBA", "P", "P+transparency", "LA"]


@functools.cache
def transformers_processor(folder: Path, backend: str) -> Any:
    """The reference: transformers' own processor for the folder, not the plugin's assembly."""
    if backend == "torchvision":
        return AutoProcessor.from_pretrained(folder, local_files_only=True)
    # AutoProcessor(backend="pil") fails: the video processor has no PIL backend.
    return Ernie4_5_VLMoeProcessor(
        image_processor=AutoImageProcessor.from_pretrained(
            folder, local_files_only=True, backend="pil"
        ),
        tokenizer=AutoTokenizer.from_pretrained(folder, local_files_only=True),
        video_processor=AutoVideoProcessor.from_pretrained(folder, local_files_only=True),
    )


def check(out: mmproc.ProcessedInputs, reference: Any, processor: mmproc.Processor) -> None:
    hf = processor.hf_processor
    assert_matches_hf(
        out,
        reference,
        fields=processor.model.get_mm_fields(processor.ctx, reference),
        placeholder_token_ids={"image": hf.image_token_id, "video": hf.video_token_id},
        normalised=processor.norm_spec is not None,
    )


@pytest.fixture(scope="module", params=["torchvision", "pil"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=[True, False], ids=["uint8", "float"])
def processor(
    converted_folder: Path, backend: str, request: pytest.FixtureRequest
) -> Iterator[mmproc.Processor]:
    with mmproc.get_processor(
        converted_folder, backend=backend, device_normalize=request.param
    ) as processor:
        yield processor


def prompt_for(images: list[Any]) -> str:
    return "<|begin_of_sentence|>User: " + "".join(
        f"Picture {i + 1}:{IMAGE}" for i in range(len(images))
    )


@pytest.mark.parametrize("mode", MODES)
def test_images_of_every_size_and_mode_equal_transformers_processor(
    processor: mmproc.Processor, converted_folder: Path, backend: str, mode: str
) -> None:
    images = [noise_image(w, h, mode, seed=i) for i, (w, h) in enumerate(SIZES)]
    prompt = prompt_for(images)
    out = processor.process(prompt, {"image": images})
    reference = transformers_processor(converted_folder, backend)(
        text=[prompt], images=images, return_tensors="pt"
    )
    check(out, reference, processor)
    assert out.features[0].data["image_grid_thw"].tolist() == [1, 4, 4]  # grown to 3136 px


def test_a_large_image_is_shrunk_to_max_pixels_as_transformers_shrinks_it(
    processor: mmproc.Processor, converted_folder: Path, backend: str
) -> None:
    images = [noise_image(2900, 1800, seed=1), noise_image(640, 480, seed=2)]
    prompt = prompt_for(images)
    out = processor.process(prompt, {"image": images})
    reference = transformers_processor(converted_folder, backend)(
        text=[prompt], images=images, return_tensors="pt"
    )
    check(out, reference, processor)
    _, h, w = out.features[0].data["image_grid_thw"].tolist()
    assert (h, w) == (122, 198) and 14 * h * 14 * w <= 6177 * 28 * 28


def test_an_image_beyond_200_to_1_is_refused_as_transformers_refuses_it(
    processor: mmproc.Processor,
) -> None:
    with pytest.raises(MediaItemError, match=r"image item 1: .*aspect ratio"):
        processor.process(IMAGE * 2, {"image": [noise_image(64, 48), noise_image(1000, 4)]})


@pytest.mark.parametrize("length", [2, 3, 6, 17])
def test_videos_of_several_lengths_equal_transformers_processor(
    converted: mmproc.Processor, converted_folder: Path, make_frames: Any, length: int
) -> None:
    videos = [make_frames(length, 64, 48, seed=length), make_frames(length + 1, 30, 112)]
    prompt = f"<|begin_of_sentence|>User: Video 1:{VIDEO}Video 2:{VIDEO}Which is longer?"
    out = converted.process(prompt, {"video": videos})
    reference = transformers_processor(converted_folder, "torchvision")(
        text=[prompt], videos=[v.copy() for v in videos], return_tensors="pt"
    )
    check(out, reference, converted)
    # An odd frame count is padded with a copy of the last frame: frames go in pairs.
    counts = [int(f.data["video_grid_thw"][0]) for f in out.features]
    assert counts == [length + length % 2, length + 1 + (length + 1) % 2]


def test_a_one_frame_video_is_processed_as_transformers_processes_its_frames(
    converted: mmproc.Processor, converted_folder: Path, make_frames: Any
) -> None:
    # transformers' own sampling step fails on a one-frame array (numpy reads the one-element
    # index tensor as a scalar index); the sampling would keep the frame, so the plugin skips it.
    video = make_frames(1, 64, 48, seed=1)
    with pytest.raises(RuntimeError):
        transformers_processor(converted_folder, "torchvision")(
            text=[VIDEO], videos=[video.copy()], return_tensors="pt"
        )
    out = converted.process(VIDEO, {"video": [video]})
    reference = transformers_processor(converted_folder, "torchvision")(
        text=[VIDEO], videos=[video.copy()], do_sample_frames=False, return_tensors="pt"
    )
    check(out, reference, converted)
    assert out.features[0].data["video_grid_thw"].tolist() == [2, 30, 40]


@pytest.mark.parametrize(
    ("frames", "sampled"),
    [(35, 16), (120, 24), (105, 21)],
    ids=["3.5s-at-least-16", "12s-at-2fps", "10.5s-odd"],
)
def test_a_video_file_is_sampled_at_2_fps_and_stamped_as_transformers_stamps_it(
    converted: mmproc.Processor, converted_folder: Path, tmp_path: Path, frames: int, sampled: int
) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(encode_video(numbered_frames(frames), fps=10))
    (item,) = parse_mm_data({"video": [str(path)]}, media=converted.media)["video"]
    assert item.num_frames == sampled
    out = converted.process(VIDEO, {"video": [str(path)]})
    reference = transformers_processor(converted_folder, "torchvision")(
        text=[VIDEO],
        videos=[item.frames.copy()],
        video_metadata=[item.metadata.to_transformers()],
        do_sample_frames=False,
        return_tensors="pt",
    )
    check(out, reference, converted)
    assert int(out.features[0].data["video_grid_thw"][0]) == sampled + sampled % 2


def test_prompt_outputs_equal_transformers_on_both_paths_and_from_the_cache(
    converted_folder: Path, make_frames: Any
) -> None:
    image, video = noise_image(150, 100, seed=3), make_frames(3, 80, 60, seed=4)
    prompt = f"a {IMAGE} b {VIDEO} a <|IMAGE_START|> c"
    reference = transformers_processor(converted_folder, "torchvision")(
        text=[prompt], images=[image], videos=[video.copy()], return_tensors="pt"
    )
    results = []
    for expansion in (False, True):
        with mmproc.get_processor(converted_folder, hf_prompt_expansion=expansion) as processor:
            for _ in range(2):  # a miss, then every item from the cache
                out = processor.process(prompt, {"image": [image], "video": [video]})
                check(out, reference, processor)
                results.append(out)
    for out in results:
        assert set(out.prompt_outputs) == {"mm_token_type_ids", "moe_mm_token_type_ids"}
        for key, value in out.prompt_outputs.items():
            assert value.tolist() == reference[key][0].tolist()
    moe = results[0].prompt_outputs["moe_mm_token_type_ids"].tolist()
    image_range, video_range = (f.placeholder for f in results[0].features)
    # The start and end tokens around each item count for its modality in the MoE mask, a
    # stray <|IMAGE_START|> in the text too, as transformers counts it.
    assert moe[image_range.offset - 1] == moe[image_range.end] == 1
    assert moe[video_range.offset - 1] == moe[video_range.end] == 2
    ids = results[0].prompt_token_ids
    stray = len(ids) - 1 - ids[::-1].index(ids[image_range.offset - 1])
    assert stray > video_range.end and moe[stray] == 1


def test_min_and_max_pixels_keys_are_ignored_as_transformers_ignores_them(
    converted_folder: Path, tmp_path: Path
) -> None:
    odd = shutil.copytree(converted_folder, tmp_path / "odd")
    settings = json.loads((odd / "preprocessor_config.json").read_text())
    settings.update(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    (odd / "preprocessor_config.json").write_text(json.dumps(settings))
    image = noise_image(1500, 1000, seed=5)
    grids = {}
    for name, folder in (("plain", converted_folder), ("odd", odd)):
        with mmproc.get_processor(folder) as processor:
            out = processor.process(IMAGE, {"image": [image]})
            grids[name] = out.features[0].data["image_grid_thw"].tolist()
    assert grids["odd"] == grids["plain"] == [1, 72, 108]
    # Only size counts: the same limits there shrink the image.
    settings["size"] = {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}
    (odd / "preprocessor_config.json").write_text(json.dumps(settings))
    with mmproc.get_processor(odd) as processor:
        out = processor.process(IMAGE, {"image": [image]})
    assert out.features[0].data["image_grid_thw"].tolist() == [1, 6, 8]


def test_processing_a_video_leaves_its_frames_as_they_were(
    converted_folder: Path, clip: Path, make_frames: Any
) -> None:
    # The stamps must land on copies: an item's frames are the caller's array and the cache's,
    # and frames stamped once would be stamped again on the next miss.
    video = make_frames(4, 64, 48, seed=6)
    before = video.copy()
    with mmproc.get_processor(converted_folder, cache_bytes=0) as processor:
        first = processor.process(VIDEO, {"video": [video]}, {"do_sample_frames": False})
        again = processor.process(VIDEO, {"video": [video]}, {"do_sample_frames": False})
        from_file = [processor.process(VIDEO, {"video": [str(clip)]}) for _ in range(2)]
    assert np.array_equal(video, before)
    for a, b in ((first, again), tuple(from_file)):
        assert torch.equal(
            a.features[0].data["pixel_values_videos"], b.features[0].data["pixel_values_videos"]
        )


def test_the_save_pretrained_layout_gives_what_the_hub_layout_gives(
    converted_folder: Path, tmp_path: Path, make_frames: Any
) -> None:
    saved = write_converted_folder(tmp_path / "saved", layout="save_pretrained")
    assert (saved / "processor_config.json").is_file()
    assert not (saved / "video_preprocessor_config.json").exists()
    mm_data = {"image": [noise_image(90, 60, seed=7)], "video": [make_frames(2, 64, 48, seed=8)]}
    outs = []
    for folder in (converted_folder, saved):
        with mmproc.get_processor(folder) as processor:
            outs.append(processor.process(f"{IMAGE} and {VIDEO}", mm_data))
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    for a, b in zip(outs[0].features, outs[1].features, strict=True):
        assert all(torch.equal(a.data[k], b.data[k]) for k in a.data)


def test_a_folder_without_its_font_is_refused_naming_the_file(tmp_path: Path) -> None:
    for layout in ("hub", "save_pretrained"):
        folder = write_converted_folder(tmp_path / layout, layout=layout, font=False)
        with pytest.raises(ProcessorLoadError, match=r"has no Roboto-Regular\.ttf, the font"):
            mmproc.get_processor(folder)


def test_a_video_config_naming_no_font_draws_with_the_folders_font(
    converted_folder: Path, tmp_path: Path, make_frames: Any
) -> None:
    # transformers resolves the font in the folder only when the file names it; otherwise it
    # would look for "Roboto-Regular.ttf" wherever the server runs, at the first video.
    bare = shutil.copytree(converted_folder, tmp_path / "bare")
    settings = json.loads((bare / "video_preprocessor_config.json").read_text())
    del settings["font"], settings["draw_on_frames"]
    (bare / "video_preprocessor_config.json").write_text(json.dumps(settings))
    video = make_frames(2, 64, 48, seed=9)
    outs = []
    for folder in (converted_folder, bare):
        with mmproc.get_processor(folder) as processor:
            outs.append(processor.process(VIDEO, {"video": [video]}))
            assert Path(processor.hf_processor.video_processor.font).parent == folder
    assert torch.equal(
        outs[0].features[0].data["pixel_values_videos"],
        outs[1].features[0].data["pixel_values_videos"],
    )


def test_config_ids_that_disagree_with_the_tokenizer_are_refused(
    converted_folder: Path, tmp_path: Path
) -> None:
    odd = shutil.copytree(converted_folder, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    config["video_token_id"] += 1
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ProcessorLoadError, match=r"video_token_id is \d+, but .*<\|VIDEO_PLACEHOLDER"
    ):
        mmproc.get_processor(odd)


def test_an_unknown_backend_is_refused(converted_folder: Path) -> None:
    with pytest.raises(ConfigurationError, match="backend must be one of torchvision, pil"):
        mmproc.get_processor(converted_folder, backend="cv2")
