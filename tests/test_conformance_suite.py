"""The conformance suite's matrix is generated from each class's settings: a test that cannot
apply to a class (image modes for an audio model, HF comparisons without an HF reference, the
``hf_kwargs`` check without ``request_kwargs``) is not generated, rather than skipped, and the
size matrix runs once per size of the class.

pytest collects real suite classes in a fresh interpreter; collecting runs no fixture, so no
model is loaded.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from mmproc.testing.suite import IMAGE_SIZES

CLASSES = """
from mmproc.testing.suite import PluginConformance


class TestImages(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"


class TestVideo(TestImages):
    modality = "video"


class TestImagesAgain(TestVideo):
    modality = "image"
    sizes = ((10, 20),)


class TestAudio(PluginConformance):
    plugin = "midashenglm"
    model = "demo:midashenglm"
    modality = "audio"


class TestNoReference(TestImages):
    compare_with_hf = False


class TestSmallerPerRequest(TestImages):
    request_kwargs = {"size": {"shortest_edge": 3136, "longest_edge": 78400}}
"""

IMAGE_MODES = "test_every_image_mode_matches_the_hf_processor"
HF_KWARGS = "test_per_request_hf_kwargs_match_the_hf_processor_called_with_them"
REQUESTS = "test_requests_match_the_hf_processor"
EVERY_MODALITY = "test_a_request_of_every_modality_the_model_takes_matches_the_hf_processor"
ALONE = "test_an_item_in_a_batch_of_others_equals_the_item_processed_alone"


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Class name -> the test ids pytest collects for it from :data:`CLASSES`."""
    tmp_path = tmp_path_factory.mktemp("suite-classes")
    (tmp_path / "test_generated.py").write_text(CLASSES)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    tests: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("test_generated.py::"):
            _, cls, test = line.split("::")
            tests.setdefault(cls, []).append(test)
    return tests


def names(tests: list[str], name: str) -> list[str]:
    """The ids of ``tests`` that are ``name`` (parametrised or not)."""
    return [t for t in tests if t == name or t.startswith(name + "[")]


def test_tests_that_cannot_apply_to_a_class_are_not_generated(
    collected: dict[str, list[str]],
) -> None:
    tests = collected
    assert len(names(tests["TestImages"], IMAGE_MODES)) == 7
    assert names(tests["TestImages"], HF_KWARGS) == []  # no request_kwargs: nothing to check
    for video_or_audio in ("TestVideo", "TestAudio"):
        assert names(tests[video_or_audio], IMAGE_MODES) == [], video_or_audio
        assert len(names(tests[video_or_audio], REQUESTS)) == 8, video_or_audio
        assert names(tests[video_or_audio], ALONE) == [ALONE], video_or_audio
    # A subclass that is an image class again gets the image modes back.
    assert len(names(tests["TestImagesAgain"], IMAGE_MODES)) == 7
    for comparison in (REQUESTS, IMAGE_MODES, EVERY_MODALITY):
        assert names(tests["TestNoReference"], comparison) == [], comparison
    assert names(tests["TestNoReference"], ALONE) == [ALONE]
    assert names(tests["TestSmallerPerRequest"], HF_KWARGS) == [HF_KWARGS]


def test_the_size_matrix_runs_once_per_size_of_the_class(
    collected: dict[str, list[str]],
) -> None:
    tests = collected
    size_test = "test_odd_sizes_match_the_hf_processor_and_both_paths"
    assert names(tests["TestImages"], size_test) == [
        f"{size_test}[{width}x{height}]" for width, height in IMAGE_SIZES
    ]
    assert names(tests["TestVideo"], size_test) == [
        f"{size_test}[64x48]",
        f"{size_test}[56x56]",
        f"{size_test}[112x30]",
    ]
    assert names(tests["TestImagesAgain"], size_test) == [f"{size_test}[10x20]"]


def test_the_default_image_sizes_reach_tiling_and_resizing_bounds() -> None:
    widths, heights = zip(*IMAGE_SIZES, strict=True)
    assert any(w * h > 384 * 384 * 4 for w, h in IMAGE_SIZES)  # large: several 384 tiles
    assert any(w / h >= 20 for w, h in IMAGE_SIZES)  # very wide
    assert any(h / w >= 20 for w, h in IMAGE_SIZES)  # very tall
    assert min(widths) < 14 and min(heights) < 14  # tiny: below a patch


def test_media_items_take_frame_counts_in_turn() -> None:
    from mmproc.testing import media_items

    videos = media_items("video", 4, seed=0, sizes=[(20, 10)], frame_counts=(4, 3, 2))
    assert [video.shape for video in videos] == [
        (4, 10, 20, 3),
        (3, 10, 20, 3),
        (2, 10, 20, 3),
        (4, 10, 20, 3),
    ]
