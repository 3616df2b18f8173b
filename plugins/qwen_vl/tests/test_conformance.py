"""mmproc's conformance suite on the qwen_vl plugin: both image backends, video, Qwen2.5-VL."""

from typing import Any, ClassVar

from mmproc.testing.suite import PluginConformance

# A smaller pixel budget per request, as a server might give a low-detail image.
SMALLER = {"size": {"shortest_edge": 3136, "longest_edge": 100 * 28 * 28}}


class TestQwen2VLImagesTorchvision(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"
    request_kwargs: ClassVar[dict[str, Any]] = SMALLER


class TestQwen2VLImagesPil(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}
    request_kwargs: ClassVar[dict[str, Any]] = SMALLER


class TestQwen2VLVideo(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2-vl"
    modality = "video"
    sizes = ((64, 48), (56, 56), (112, 30))


class TestQwen25VLImages(PluginConformance):
    plugin = "qwen_vl"
    model = "demo:qwen2.5-vl"
    request_kwargs: ClassVar[dict[str, Any]] = SMALLER
