"""Registration module of the qwen_vl plugin: light, imports no model code."""

from mmproc.plugin import hookimpl

QWEN2_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
QWEN3_ARCHITECTURES = (
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
"""The architectures served on transformers' ``Qwen3VLProcessor``, with video timestamps."""
ARCHITECTURES = (*QWEN2_ARCHITECTURES, *QWEN3_ARCHITECTURES)

# (demo name, writer in mmproc_qwen_vl.demo, family); qwen2-vl first: `mmproc demo`'s default.
_DEMOS = (
    ("qwen2-vl", "write_qwen2_vl_demo", "Qwen2-VL"),
    ("qwen2.5-vl", "write_qwen2_5_vl_demo", "Qwen2.5-VL"),
    ("qwen3-vl", "write_qwen3_vl_demo", "Qwen3-VL"),
    ("qwen3-vl-moe", "write_qwen3_vl_moe_demo", "Qwen3-VL-MoE"),
    ("qwen3.5", "write_qwen3_5_demo", "Qwen3.5"),
    ("qwen3.5-moe", "write_qwen3_5_moe_demo", "Qwen3.5-MoE"),
)


@hookimpl
def mmproc_register_models(registry):
    """Serve Qwen2-VL and Qwen2.5-VL with :class:`mmproc_qwen_vl.model.QwenVLModel`, Qwen3-VL,
    Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE with :class:`mmproc_qwen_vl.model.Qwen3VLModel`, and
    offer a demo model of each."""
    registry.register(list(QWEN2_ARCHITECTURES), "mmproc_qwen_vl.model:QwenVLModel")
    registry.register(list(QWEN3_ARCHITECTURES), "mmproc_qwen_vl.model:Qwen3VLModel")
    for name, writer, family in _DEMOS:
        registry.register_demo(
            name,
            f"mmproc_qwen_vl.demo:{writer}",
            description=f"tiny {family} folder: real special tokens, processor settings, template",
        )
