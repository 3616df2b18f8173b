"""mmproc's conformance suite on the sarashina2 plugin, both image backends."""

from typing import ClassVar

from mmproc.testing.suite import PluginConformance


class TestSarashina2VisionTorchvision(PluginConformance):
    plugin = "sarashina2"
    model = "demo:sarashina2"


class TestSarashina2VisionPil(TestSarashina2VisionTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}
