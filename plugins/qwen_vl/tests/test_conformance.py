"""mmproc's conformance suite on the qwen_vl plugin: both image backends, video, Qwen2.5-VL."""

from typing import Any, ClassVar

from mmproc.testing.suite import PluginConformance


class TestQwen2VLImagesTorchvision(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"
    # A smaller pixel budget per request, as a server might give a low-detail image.
    request_kwargs: ClassVar[dict[str, Any]] = {
        "size": {"shortest_edge": 3136, "longest_edge": 78400}
    }


class TestQwen2VLImagesPil(TestQwen2VLImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestQwen2VLVideo(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"
    modality = "video"
    sizes = ((64, 48), (56, 56), (112, 30))


class TestQwen25VLImages(TestQwen2VLImagesTorchvision):
    model = "demo:qwen2.5-vl"
