"""Qwen-Image (text-to-image) and Qwen-Image-Edit (image + instruction → image), split by stage."""
