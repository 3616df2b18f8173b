"""Registration module of the sarashina2 plugin: light, imports no model code."""

from mmproc.plugin import hookimpl


@hookimpl
def mmproc_register_models(registry):
    """Serve Sarashina2-Vision with :class:`mmproc_sarashina2.model.Sarashina2VisionModel`, and
    offer its demo model."""
    registry.register(
        "Sarashina2VisionForCausalLM", "mmproc_sarashina2.model:Sarashina2VisionModel"
    )
    registry.register_demo(
        "sarashina2",
        "mmproc_sarashina2.demo:write_demo_folder",
        description="tiny Sarashina2-Vision folder: real special tokens, template, settings",
    )
