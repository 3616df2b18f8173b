"""mmproc's plugin for InternVL3 in its transformers form (``InternVLForConditionalGeneration``).

``plugin`` registers the architecture and the demo model (light: imports no model code);
``model`` holds the hooks; ``loading`` builds the processor from a model folder on either image
backend; ``demo`` writes the demo folder.
"""
