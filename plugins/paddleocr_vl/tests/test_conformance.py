"""mmproc's conformance suite on the paddleocr_vl plugin, both image backends."""

from typing import Any, ClassVar

from mmproc.testing.suite import PluginConformance

# A smaller pixel budget per request, as a server might give a low-detail image.
SMALLER = {"size": {"shortest_edge": 3136, "longest_edge": 100 * 28 * 28}}


class TestPaddleOCRVLTorchvision(PluginConformance):
    plugin = "paddleocr_vl"
    model = "demo:paddleocr-vl"
    request_kwargs: ClassVar[dict[str, Any]] = SMALLER


class TestPaddleOCRVLPil(PluginConformance):
    plugin = "paddleocr_vl"
    model = "demo:paddleocr-vl"
    request_kwargs: ClassVar[dict[str, Any]] = SMALLER
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}
