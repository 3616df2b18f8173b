"""mmproc's plugin for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (and their MoE models): images
and video on transformers' own processors.

``plugin`` registers the architectures and demo models (light: imports no model code); ``model``
holds the hooks; ``loading`` builds the processor from a model folder on either image backend;
``timestamps`` is where Qwen3's video frames came from and the times the prompt shows;
``image_fast_path`` and ``torch_fast_path`` are the native uint8 image paths; ``shared`` is what
plugins of other models built on Qwen2-VL's image processing use; ``demo`` writes the demo
folders.
"""
