"""Registration module of the paddleocr_vl plugin: light, imports no model code."""

from mmproc import hookimpl


@hookimpl
def mmproc_register_models(registry):  # type: ignore[no-untyped-def]
    """Serve PaddleOCR-VL with :class:`mmproc_paddleocr_vl.model.PaddleOCRVLModel`."""
    registry.register(
        "PaddleOCRVLForConditionalGeneration", "mmproc_paddleocr_vl.model:PaddleOCRVLModel"
    )
