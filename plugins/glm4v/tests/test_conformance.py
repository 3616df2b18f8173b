"""mmproc's conformance suite on the glm4v plugin: each release, both image backends, video.

GLM's prompt gives each video frame pair its timestamp, so its videos need their metadata: the
suite's videos get one (frames sampled at 2 fps), which the kit hands transformers with them, as a
user calls transformers with a video's metadata.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from mmproc.testing import media_items
from mmproc.testing.suite import PluginConformance


class GlmConformance(PluginConformance):
    plugin = "glm4v"
    model = "demo:glm-4.1v"
    # A smaller pixel budget per request, as a server might give a low-detail image.
    request_kwargs: ClassVar[dict[str, Any] | None] = {
        "size": {"shortest_edge": 12544, "longest_edge": 78400}
    }

    @pytest.fixture(autouse=True)
    def _metadata(self, video_with_metadata: Any) -> None:
        self.with_metadata = video_with_metadata

    def items(self, count: int, seed: int = 0, modality: str | None = None) -> list[Any]:
        """The suite's items; videos with the metadata of 2 fps sampling."""
        items = super().items(count, seed, modality)
        if (modality or self.modality) != "video":
            return items
        return [self.with_metadata(frames) for frames in items]


class TestGlm41VImagesTorchvision(GlmConformance):
    pass


class TestGlm41VImagesPil(GlmConformance):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestGlm41VVideo(GlmConformance):
    modality = "video"
    request_kwargs = None

    def test_odd_sizes_match_the_hf_processor_and_both_paths(
        self, processor: Any, expanding: Any, item_size: tuple[int, int]
    ) -> None:
        # The suite's test makes its video with media_items, not items(): here it gets the
        # metadata GLM needs, and the same checks follow.
        seed = 20 + self.sizes_of("video").index(item_size)
        (frames,) = media_items("video", 1, seed=seed, sizes=[item_size], frame_counts=(3,))
        video = self.with_metadata(frames)
        prompt = self.prompt(processor, 1)
        self.check_against_hf(processor, prompt, [video], as_ids=False, context=str(item_size))
        cached, hf_expanded = (
            p.process(prompt, {"video": [video]}) for p in (processor, expanding)
        )
        assert cached.prompt_token_ids == hf_expanded.prompt_token_ids
        assert [f.placeholder for f in cached.features] == [
            f.placeholder for f in hf_expanded.features
        ]


class TestGlm45VImages(GlmConformance):
    model = "demo:glm-4.5v"


class TestGlm46VImagesPil(GlmConformance):
    model = "demo:glm-4.6v"
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestGlm46VVideo(TestGlm41VVideo):
    model = "demo:glm-4.6v"
