"""Requests mixing images and videos, on both layouts: each item expands at its own marker in
prompt order on both paths, and two workers serve them each on its own processor clone, the
original never touched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mmproc
import pytest
import torch
from mmproc.testing import noise_image
from mmproc.testing.probes import poisoned
from mmproc_ernie45_vl.model import CONVERTED_IMAGE_PLACEHOLDER, CONVERTED_VIDEO_PLACEHOLDER
from mmproc_ernie45_vl.original import IMAGE_MARKER, VIDEO_MARKER

MARKERS = {
    "converted": (CONVERTED_IMAGE_PLACEHOLDER, CONVERTED_VIDEO_PLACEHOLDER),
    "original": (IMAGE_MARKER, VIDEO_MARKER),
}


@pytest.fixture(params=sorted(MARKERS))
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def folder(layout: str, converted_folder: Path, original_folder: Path) -> Path:
    return converted_folder if layout == "converted" else original_folder


def mixed_requests(layout: str, make_frames: Any) -> list[tuple[str, dict[str, list[Any]]]]:
    """Six requests: 0-2 images and 0-2 videos, videos before, between and after images."""
    image, video = MARKERS[layout]
    pictures = [noise_image(60 + 20 * i, 40 + 10 * i, seed=i) for i in range(3)]
    clips = [make_frames(2 + i, 48, 40 + 8 * i, seed=10 + i) for i in range(3)]
    return [
        (
            f"Video 1:{video}Picture 1:{image}Same scene?",
            {"image": pictures[:1], "video": clips[:1]},
        ),
        (
            f"Picture 1:{image}Video 1:{video}Picture 2:{image}",
            {"image": pictures[1:], "video": clips[1:2]},
        ),
        (f"{video}{video} and {image}", {"image": pictures[2:], "video": clips[1:]}),
        (f"Only {video}", {"video": clips[2:]}),
        (f"Only {image}", {"image": pictures[:1]}),
        ("No media at all.", {}),
    ]


def same(a: mmproc.ProcessedInputs, b: mmproc.ProcessedInputs) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert [(f.modality, f.item_index, f.placeholder) for f in a.features] == [
        (f.modality, f.item_index, f.placeholder) for f in b.features
    ]
    for fa, fb in zip(a.features, b.features, strict=True):
        assert set(fa.data) == set(fb.data)
        assert all(torch.equal(fa.data[k], fb.data[k]) for k in fa.data)
    assert set(a.prompt_outputs) == set(b.prompt_outputs)
    assert all(torch.equal(a.prompt_outputs[k], b.prompt_outputs[k]) for k in a.prompt_outputs)


def test_each_item_expands_at_its_own_marker_in_prompt_order_on_both_paths(
    folder: Path, layout: str, make_frames: Any
) -> None:
    with (
        mmproc.get_processor(folder) as cached,
        mmproc.get_processor(folder, hf_prompt_expansion=True) as expanding,
    ):
        tokenizer = cached.hf_processor.tokenizer
        starts = {
            m: tokenizer.convert_tokens_to_ids(f"<|{m.upper()}_START|>") for m in ("image", "video")
        }
        image, video = MARKERS[layout]
        for prompt, mm_data in mixed_requests(layout, make_frames):
            out = cached.process(prompt, mm_data)
            same(expanding.process(prompt, mm_data), out)
            same(cached.process(prompt, mm_data), out)  # every item from the cache
            # Features in prompt order; each modality's items in request order.
            order = sorted(
                [(at, "image") for at in _spots(prompt, image)]
                + [(at, "video") for at in _spots(prompt, video)]
            )
            assert [f.modality for f in out.features] == [m for _, m in order]
            for feature in out.features:
                at = feature.placeholder.offset
                # converted ranges hold the placeholder tokens, original ranges the whole marker
                before = at - 1 if layout == "converted" else at
                assert out.prompt_token_ids[before] == starts[feature.modality]
            assert {len(v) for v in out.prompt_outputs.values()} <= {len(out.prompt_token_ids)}


def _spots(text: str, marker: str) -> list[int]:
    spots, at = [], text.find(marker)
    while at >= 0:
        spots.append(at)
        at = text.find(marker, at + 1)
    return spots


def test_two_workers_each_run_on_their_own_clone_while_the_original_is_poisoned(
    folder: Path, layout: str, make_frames: Any
) -> None:
    requests = mixed_requests(layout, make_frames) * 2
    with mmproc.get_processor(folder, workers=1, cache_bytes=0) as one:
        expected = [one.process(prompt, mm_data) for prompt, mm_data in requests]
    with mmproc.get_processor(folder, workers=2, cache_bytes=0, warm_up=True) as two:
        assert two.workers == 2
        # Any use of the processor the pool cloned from raises: every hook call must use the
        # worker's clone it is given.
        with poisoned(two.hf_processor, what="the original processor"):
            with ThreadPoolExecutor(4) as callers:
                results = list(callers.map(lambda r: two.process(*r), requests))
    for got, want in zip(results, expected, strict=True):
        same(got, want)
