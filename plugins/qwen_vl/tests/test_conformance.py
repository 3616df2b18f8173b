"""mmproc's conformance suite on the qwen_vl plugin: every family's demo model, both image
backends, video."""

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


# --- Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE: patch 16, videos with timestamps ---------------


class Qwen3Images(PluginConformance):
    plugin = "qwen_vl"
    # Qwen3's budget is 256x256 to 4096x4096 pixels; a request may lower both.
    request_kwargs: ClassVar[dict[str, Any]] = {
        "size": {"shortest_edge": 16384, "longest_edge": 65536}
    }


class Qwen3Video(PluginConformance):
    plugin = "qwen_vl"
    modality = "video"
    # Odd counts too: the last frame is repeated, and the pair's timestamp with it.
    frame_counts = (4, 3, 2, 5, 7)
    # The video budget counts every frame's pixels, 4096 at the least.
    request_kwargs: ClassVar[dict[str, Any]] = {
        "size": {"shortest_edge": 4096, "longest_edge": 8192}
    }


class TestQwen3VLImagesTorchvision(Qwen3Images):
    model = "demo:qwen3-vl"


class TestQwen3VLImagesPil(TestQwen3VLImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestQwen3VLVideo(Qwen3Video):
    model = "demo:qwen3-vl"


class TestQwen3VLMoeImagesTorchvision(Qwen3Images):
    model = "demo:qwen3-vl-moe"


class TestQwen3VLMoeImagesPil(TestQwen3VLMoeImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestQwen3VLMoeVideo(Qwen3Video):
    model = "demo:qwen3-vl-moe"


class TestQwen35ImagesTorchvision(Qwen3Images):
    model = "demo:qwen3.5"


class TestQwen35ImagesPil(TestQwen35ImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestQwen35Video(Qwen3Video):
    model = "demo:qwen3.5"


class TestQwen35MoeImagesTorchvision(Qwen3Images):
    model = "demo:qwen3.5-moe"


class TestQwen35MoeImagesPil(TestQwen35MoeImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestQwen35MoeVideo(Qwen3Video):
    model = "demo:qwen3.5-moe"
