"""mmproc's plugin for GLM-4.1V, GLM-4.5V and GLM-4.6V on transformers' own processors: images
and videos as Qwen2-VL-style patches, each video frame pair with its timestamp in the prompt.

``plugin`` registers the architectures and demo models (light: imports no model code);
``model`` holds the hooks; ``loading`` builds the processor the folder names on either image
backend; ``demo`` writes the demo folders.
"""
