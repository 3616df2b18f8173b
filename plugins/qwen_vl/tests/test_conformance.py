"""mmproc's conformance suite on the qwen_vl plugin: both image backends, video, Qwen2.5-VL."""

from typing import ClassVar

from mmproc.testing.suite import PluginConformance


class TestQwen2VLImagesTorchvision(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"


class TestQwen2VLImagesPil(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestQwen2VLVideo(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"
    modality = "video"
    sizes = ((64, 48), (56, 56), (112, 30))


class TestQwen25VLImages(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2.5-vl"
