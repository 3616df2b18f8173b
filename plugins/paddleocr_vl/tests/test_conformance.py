"""mmproc's conformance suite on the paddleocr_vl plugin, both image backends."""

from typing import Any, ClassVar

from mmproc.testing.suite import PluginConformance


class TestPaddleOCRVLTorchvision(PluginConformance):
    plugin = "paddleocr_vl"
    model = "demo:paddleocr-vl"
    # A smaller pixel budget per request, as a server might give a low-detail image.
    request_kwargs: ClassVar[dict[str, Any]] = {
        "size": {"shortest_edge": 3136, "longest_edge": 100 * 28 * 28}
    }


class TestPaddleOCRVLPil(TestPaddleOCRVLTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}
