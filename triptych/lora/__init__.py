"""LoRA adapters as rows of a batch: file format, per-row deltas, byte-budgeted store, head catalog (docs/lora.md)."""
