"""mmproc's conformance suite on the ernie45_vl plugin: both layouts, images and video, both
image backends of the converted layout."""

from __future__ import annotations

from typing import ClassVar

from mmproc.testing.suite import PluginConformance


class ConvertedConformance(PluginConformance):
    plugin = "ernie45_vl"
    model = "demo:ernie45-vl"


class OriginalConformance(PluginConformance):
    plugin = "ernie45_vl"
    model = "demo:ernie45-vl-original"
    # The original layout's processor is the plugin's own (Baidu's rules without their code):
    # its apply_chat_template renders text and loads no media (tests/test_chat.py covers it).
    compare_chat_with_hf = False


class TestConvertedImagesTorchvision(ConvertedConformance):
    pass


class TestConvertedImagesPil(ConvertedConformance):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestConvertedVideo(ConvertedConformance):
    modality = "video"
    sizes = ((64, 48), (28, 28), (112, 30))


class TestOriginalImages(OriginalConformance):
    pass


class TestOriginalVideo(OriginalConformance):
    modality = "video"
    sizes = ((64, 48), (28, 28), (112, 30))
