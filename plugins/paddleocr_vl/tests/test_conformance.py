"""mmproc's conformance suite on the paddleocr_vl plugin, both image backends."""

from typing import ClassVar

from mmproc.testing.suite import PluginConformance


class TestPaddleOCRVLTorchvision(PluginConformance):
    plugin = "paddleocr_vl"
    model = "demo:paddleocr-vl"


class TestPaddleOCRVLPil(PluginConformance):
    plugin = "paddleocr_vl"
    model = "demo:paddleocr-vl"
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}
