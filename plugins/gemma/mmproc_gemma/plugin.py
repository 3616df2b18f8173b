"""Registration module of the gemma plugin: light, imports no model code."""

from mmproc.plugin import hookimpl

MODELS = {
    "Gemma3ForConditionalGeneration": "mmproc_gemma.model:Gemma3Model",
    "Gemma3nForConditionalGeneration": "mmproc_gemma.model:Gemma3nModel",
    "Gemma4ForConditionalGeneration": "mmproc_gemma.model:Gemma4Model",
}

DEMOS = {
    "gemma3": ("write_gemma3_demo", "tiny Gemma 3 folder: real special tokens, settings, template"),
    "gemma3-pan-and-scan": (
        "write_gemma3_pan_and_scan_demo",
        "tiny Gemma 3 folder with pan-and-scan crops switched on in its preprocessor settings",
    ),
    "gemma3n": ("write_gemma3n_demo", "tiny Gemma 3n folder: images and audio, real settings"),
    "gemma4": ("write_gemma4_demo", "tiny Gemma 4 folder: images, video and audio, real settings"),
}


@hookimpl
def mmproc_register_models(registry):
    """Serve each Gemma family with its model class, and offer a demo model of each."""
    for architecture, target in MODELS.items():
        registry.register(architecture, target)
    for name, (function, description) in DEMOS.items():
        registry.register_demo(name, f"mmproc_gemma.demo:{function}", description=description)
