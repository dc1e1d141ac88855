"""Where an adapter's weights are: a folder or a file (torch-free: the head reads it too)."""

from __future__ import annotations

from pathlib import Path

from triptych.core.errors import TriptychError


class LoraFormatError(TriptychError, ValueError):
    """An adapter file this server cannot apply (the message names the key or module and why)."""


WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def weight_file(path: str | Path) -> Path:
    """The safetensors file of an adapter folder or file; ``LoraFormatError`` naming the path."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise LoraFormatError(f"LoRA file {str(path)!r} is not a .safetensors file")
        return path
    if not path.is_dir():
        raise LoraFormatError(f"LoRA path {str(path)!r} is neither a folder nor a .safetensors file")
    if (path / WEIGHT_NAME).is_file():
        return path / WEIGHT_NAME
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise LoraFormatError(
            f"LoRA folder {str(path)!r} has {len(files)} .safetensors files and no {WEIGHT_NAME}: name the file"
        )
    return files[0]
