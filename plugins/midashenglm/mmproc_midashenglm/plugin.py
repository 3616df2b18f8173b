"""Registration module of the midashenglm plugin: light, imports no model code."""

from mmproc.plugin import hookimpl


@hookimpl
def mmproc_register_models(registry):
    """Serve MiDashengLM with :class:`mmproc_midashenglm.model.MiDashengLMModel`, and offer its
    demo model."""
    registry.register("MiDashengLMModel", "mmproc_midashenglm.model:MiDashengLMModel")
    registry.register_demo(
        "midashenglm",
        "mmproc_midashenglm.demo:write_demo_folder",
        description="tiny MiDashengLM folder: real audio tokens and feature extractor settings",
    )
