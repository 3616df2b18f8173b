"""Registration module of the ernie45_vl plugin: light, imports no model code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmproc.plugin import hookimpl

if TYPE_CHECKING:
    from mmproc.plugin import ModelRegistrar

ARCHITECTURE = "Ernie4_5_VLMoeForConditionalGeneration"


@hookimpl
def mmproc_register_models(registry: ModelRegistrar) -> None:
    """Serve ERNIE-4.5-VL (both folder layouts) with
    :class:`mmproc_ernie45_vl.model.Ernie45VLModel`, and offer a demo model of each layout."""
    registry.register(ARCHITECTURE, "mmproc_ernie45_vl.model:Ernie45VLModel")
    registry.register_demo(
        "ernie45-vl",
        "mmproc_ernie45_vl.demo:write_converted_demo",
        description="tiny ERNIE-4.5-VL folder, transformers' converted layout (ernie4_5_vl_moe): "
        "real special tokens, processor settings and font",
    )
    registry.register_demo(
        "ernie45-vl-original",
        "mmproc_ernie45_vl.demo:write_original_demo",
        description="tiny ERNIE-4.5-VL folder, Baidu's original layout (ernie4_5_moe_vl, "
        "remote code never run): real special tokens, processor settings and font",
    )
