"""mmproc plugin for Sarashina2-Vision (``Sarashina2VisionForCausalLM``)."""
