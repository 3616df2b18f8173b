"""Registration module of the llava plugin: light, imports no model code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmproc.plugin import hookimpl

if TYPE_CHECKING:
    from mmproc.plugin import ModelRegistrar

ARCHITECTURES = (
    "LlavaOnevisionForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaNextVideoForConditionalGeneration",
)

_DEMOS = {
    "llava-onevision": ("write_onevision_demo", "LLaVA-OneVision-Qwen2-0.5B-ov-hf"),
    "llava-next": ("write_next_demo", "LLaVA-v1.6-Mistral-7B-hf"),
    "llava-next-video": ("write_next_video_demo", "LLaVA-NeXT-Video-7B-hf"),
}


@hookimpl
def mmproc_register_models(registry: ModelRegistrar) -> None:
    """Serve the three LLaVA families with :class:`mmproc_llava.model.LlavaModel`, and offer a
    demo model of each."""
    registry.register(list(ARCHITECTURES), "mmproc_llava.model:LlavaModel")
    for name, (function, checkpoint) in _DEMOS.items():
        registry.register_demo(
            name,
            f"mmproc_llava.demo:{function}",
            description=f"tiny {checkpoint} folder: real special tokens, anyres settings and "
            "chat template",
        )
