"""mmproc plugin for Gemma 3, Gemma 3n and Gemma 4: images (pan-and-scan crops too), video and
audio, identical to transformers' own processors."""
