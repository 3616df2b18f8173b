"""mmproc plugin for MiDashengLM (``MiDashengLMModel``), an audio-language model."""
