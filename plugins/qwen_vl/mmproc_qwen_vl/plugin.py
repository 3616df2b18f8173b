"""Registration module of the qwen_vl plugin: light, imports no model code."""

from mmproc.plugin import hookimpl

ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


@hookimpl
def mmproc_register_models(registry):
    """Serve Qwen2-VL and Qwen2.5-VL with :class:`mmproc_qwen_vl.model.QwenVLModel`, and offer
    a demo model of each."""
    registry.register(list(ARCHITECTURES), "mmproc_qwen_vl.model:QwenVLModel")
    registry.register_demo(
        "qwen2-vl",
        "mmproc_qwen_vl.demo:write_qwen2_vl_demo",
        description="tiny Qwen2-VL folder: real special tokens, preprocessor settings, template",
    )
    registry.register_demo(
        "qwen2.5-vl",
        "mmproc_qwen_vl.demo:write_qwen2_5_vl_demo",
        description="tiny Qwen2.5-VL folder: real special tokens, preprocessor settings, template",
    )
