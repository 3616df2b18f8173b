"""mmproc's plugin for Qwen2-VL and Qwen2.5-VL: images and video on transformers' own processors.

``plugin`` registers the architectures and demo models (light: imports no model code); ``model``
holds the hooks; ``loading`` builds the processor from a model folder on either image backend;
``image_fast_path`` and ``torch_fast_path`` are the native uint8 image paths; ``shared`` is what
plugins of other models built on Qwen2-VL's image processing use; ``demo`` writes the demo
folders.
"""
