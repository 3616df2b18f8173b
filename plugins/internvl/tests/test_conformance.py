"""mmproc's conformance suite on the internvl plugin: both image backends, a smaller tile limit
per request, and video.

The suite's reference is the processor the plugin loads (transformers' ``InternVLProcessor``
keeping images and videos apart, :class:`mmproc_internvl.loading.InternVLItemsProcessor`);
``test_identity.py`` compares with ``InternVLProcessor`` itself.
"""

from typing import Any, ClassVar

from mmproc.testing.suite import PluginConformance


class TestInternVL3ImagesTorchvision(PluginConformance):
    plugin = "internvl"
    model = "demo:internvl3"
    # A smaller tile limit, as a server might give a low-detail image.
    request_kwargs: ClassVar[dict[str, Any]] = {"max_patches": 4}


class TestInternVL3ImagesPil(TestInternVL3ImagesTorchvision):
    processor_options: ClassVar[dict[str, str]] = {"backend": "pil"}


class TestInternVL3Video(PluginConformance):
    plugin = "internvl"
    model = "demo:internvl3"
    modality = "video"
    # transformers stacks a call's videos, so its videos must have one frame count: the suite's
    # requests of several videos get one (test_identity.py mixes lengths against single calls).
    frame_counts = (3,)
