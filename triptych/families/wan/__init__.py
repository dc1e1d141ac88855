"""Wan 2.1 families (text-to-video and image-to-video), split by stage."""
