"""Registration module of the glm4v plugin: light, imports no model code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmproc.plugin import hookimpl

if TYPE_CHECKING:
    from mmproc.plugin import ModelRegistrar

ARCHITECTURES = (
    "Glm4vForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration",
    "Glm46VForConditionalGeneration",
)

# Demo model name -> the checkpoint it stands for (its writer is demo.write_glm4Xv_demo).
RELEASES = {
    "4.1v": "GLM-4.1V-9B-Thinking (Glm4vProcessor)",
    "4.5v": "GLM-4.5V, the MoE one (Glm4vProcessor)",
    "4.6v": "GLM-4.6V (MoE architecture, Glm46VProcessor)",
}


@hookimpl
def mmproc_register_models(registry: ModelRegistrar) -> None:
    """Serve the GLM-4.xV architectures with :class:`mmproc_glm4v.model.Glm4vModel`, and offer
    a demo model of each release (``demo:glm-4.1v`` ...)."""
    registry.register(list(ARCHITECTURES), "mmproc_glm4v.model:Glm4vModel")
    for release, checkpoint in RELEASES.items():
        writer = "write_glm" + release.replace(".", "") + "_demo"
        about = f"tiny {checkpoint} folder: real special tokens, patch and video settings"
        registry.register_demo(f"glm-{release}", f"mmproc_glm4v.demo:{writer}", description=about)
