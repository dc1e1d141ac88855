"""FLUX.1 family (guidance-distilled dev-style and schnell-style), split by stage."""
