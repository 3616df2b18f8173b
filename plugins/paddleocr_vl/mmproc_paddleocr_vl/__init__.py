"""mmproc plugin for PaddleOCR-VL."""
