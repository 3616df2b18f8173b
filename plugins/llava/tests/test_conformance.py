"""mmproc's conformance suite on the llava plugin: the three families on both image backends,
and video for the two that take it."""

from __future__ import annotations

from typing import Any, ClassVar

from mmproc.testing.suite import PluginConformance


class TestOneVisionImagesTorchvision(PluginConformance):
    plugin = "llava"
    model = "demo:llava-onevision"
    # Tiles of 192 instead of 384: twice the tiles per side, another token count.
    request_kwargs: ClassVar[dict[str, Any]] = {"size": {"height": 192, "width": 192}}
    # transformers' apply_chat_template processes a chat of several images in a multi-image
    # mode where each image's outputs depend on the others; mmproc processes each image as if
    # alone (as vLLM does), so only single-image chats compare (test_identity.py).
    compare_chat_with_hf = False


class TestOneVisionImagesPil(TestOneVisionImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestOneVisionVideo(PluginConformance):
    plugin = "llava"
    model = "demo:llava-onevision"
    modality = "video"
    # transformers stacks a call's videos: one frame count for the suite's multi-video requests
    # (test_identity.py mixes lengths against single calls).
    frame_counts = (3,)


class TestNextImagesTorchvision(PluginConformance):
    plugin = "llava"
    model = "demo:llava-next"
    request_kwargs: ClassVar[dict[str, Any]] = {"resample": 2}  # bilinear


class TestNextImagesPil(TestNextImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestNextVideoImagesTorchvision(TestNextImagesTorchvision):
    model = "demo:llava-next-video"


class TestNextVideoImagesPil(TestNextVideoImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestNextVideoVideo(TestOneVisionVideo):
    model = "demo:llava-next-video"
