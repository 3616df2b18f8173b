"""Registration module of the internvl plugin: light, imports no model code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmproc.plugin import hookimpl

if TYPE_CHECKING:
    from mmproc.plugin import ModelRegistrar

ARCHITECTURE = "InternVLForConditionalGeneration"


@hookimpl
def mmproc_register_models(registry: ModelRegistrar) -> None:
    """Serve InternVL3 (transformers' form) with :class:`mmproc_internvl.model.InternVLModel`,
    and offer its demo model."""
    registry.register(ARCHITECTURE, "mmproc_internvl.model:InternVLModel")
    registry.register_demo(
        "internvl3",
        "mmproc_internvl.demo:write_internvl3_demo",
        description="tiny InternVL3-1B-hf folder: real special tokens, 448-pixel tiling settings "
        "and chat template",
    )
