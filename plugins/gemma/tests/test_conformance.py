"""mmproc's conformance suite on the gemma plugin: each family's demo model, both image
backends, pan-and-scan on and off, Gemma 4's video and both families' audio."""

from __future__ import annotations

from typing import Any, ClassVar

from mmproc.testing.suite import IMAGE_SIZES, PluginConformance


class TestGemma3Torchvision(PluginConformance):
    plugin = "gemma"
    model = "demo:gemma3"
    # A smaller image size per request: it changes every image's pixels (not its token count).
    request_kwargs: ClassVar[dict[str, Any]] = {"size": {"height": 448, "width": 448}}


class TestGemma3Pil(TestGemma3Torchvision):
    processor_options: ClassVar[dict[str, Any]] = {"backend": "pil"}


class TestGemma3PanAndScanTorchvision(PluginConformance):
    plugin = "gemma"
    model = "demo:gemma3-pan-and-scan"
    # The matrix's sizes (1000 x 700 gets 2 crops; the others are too thin or too small for
    # crops of 256 pixels), and a landscape and a portrait image of 3 crops each.
    sizes = (*IMAGE_SIZES, (900, 300), (300, 900))
    # Smaller crops from a smaller aspect ratio: small images get crops too.
    request_kwargs: ClassVar[dict[str, Any]] = {
        "pan_and_scan_min_crop_size": 16,
        "pan_and_scan_min_ratio_to_activate": 1.1,
    }


class TestGemma3PanAndScanPil(TestGemma3PanAndScanTorchvision):
    processor_options: ClassVar[dict[str, Any]] = {"backend": "pil"}


class TestGemma3nImagesTorchvision(PluginConformance):
    plugin = "gemma"
    model = "demo:gemma3n"
    request_kwargs: ClassVar[dict[str, Any]] = {"size": {"height": 384, "width": 384}}


class TestGemma3nImagesPil(TestGemma3nImagesTorchvision):
    processor_options: ClassVar[dict[str, Any]] = {"backend": "pil"}


class TestGemma3nAudio(PluginConformance):
    plugin = "gemma"
    model = "demo:gemma3n"
    modality = "audio"
    # transformers gives a clip of a batch of clips of other lengths frames that run past its
    # end into the padding: its features depend on its batch, which a cached item's cannot.
    # mmproc gives each clip what transformers gives it alone; test_gemma3n.py compares with
    # that, clip by clip (one clip alone, and with images, the suite compares as it is).
    compare_with_hf = False


class TestGemma4ImagesTorchvision(PluginConformance):
    plugin = "gemma"
    model = "demo:gemma4"
    # The matrix's videos are bare frames: the rate transformers assumes for them, said aloud.
    processor_options: ClassVar[dict[str, Any]] = {"video_fps": 24.0}
    # A smaller token budget per image: fewer soft tokens, other pixels.
    request_kwargs: ClassVar[dict[str, Any]] = {"max_soft_tokens": 70}


class TestGemma4ImagesPil(TestGemma4ImagesTorchvision):
    processor_options: ClassVar[dict[str, Any]] = {"video_fps": 24.0, "backend": "pil"}


class TestGemma4Video(PluginConformance):
    plugin = "gemma"
    model = "demo:gemma4"
    modality = "video"
    processor_options: ClassVar[dict[str, Any]] = {"video_fps": 24.0}
    request_kwargs: ClassVar[dict[str, Any]] = {"max_soft_tokens": 140}


class TestGemma4Audio(PluginConformance):
    plugin = "gemma"
    model = "demo:gemma4"
    modality = "audio"
    processor_options: ClassVar[dict[str, Any]] = {"video_fps": 24.0}
