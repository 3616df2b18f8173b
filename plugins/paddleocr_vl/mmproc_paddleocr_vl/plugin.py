"""Registration module of the paddleocr_vl plugin: light, imports no model code."""

from mmproc.plugin import hookimpl


@hookimpl
def mmproc_register_models(registry):
    """Serve PaddleOCR-VL with :class:`mmproc_paddleocr_vl.model.PaddleOCRVLModel`, and offer
    its demo model."""
    registry.register(
        "PaddleOCRVLForConditionalGeneration", "mmproc_paddleocr_vl.model:PaddleOCRVLModel"
    )
    registry.register_demo(
        "paddleocr-vl",
        "mmproc_paddleocr_vl.demo:write_paddleocr_vl_demo",
        description="tiny PaddleOCR-VL folder: real special tokens, preprocessor settings",
    )
