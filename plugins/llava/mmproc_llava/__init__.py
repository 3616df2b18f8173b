"""mmproc's plugin for LLaVA-OneVision, LLaVA-NeXT and LLaVA-NeXT-Video on transformers' own
processors: anyres tiling, unpadded features with newline tokens, tiles padded per batch.

``plugin`` registers the architectures and demo models (light: imports no model code);
``model`` holds the hooks; ``loading`` builds each family's processor on either image backend;
``demo`` writes the demo folders.
"""
