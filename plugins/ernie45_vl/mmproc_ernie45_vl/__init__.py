"""mmproc plugin for ERNIE-4.5-VL (``Ernie4_5_VLMoeForConditionalGeneration``), both folder
layouts."""
