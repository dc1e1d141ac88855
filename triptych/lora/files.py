"""Reading adapter files: a folder (diffusers' ``pytorch_lora_weights.safetensors``, or its only
``.safetensors`` file) or one ``.safetensors`` file, through the family's own diffusers pipeline class
``lora_state_dict`` (the reader behind ``load_lora_weights``, with its format conversions), so what
diffusers loads for the family is what loads here. Local files only: never a hub name or a URL."""

from __future__ import annotations

import inspect
from pathlib import Path

from triptych.lora.adapter import Adapter, LoraFormatError, from_state_dict

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


def read_adapter(name: str, path: str | Path, pipeline_class) -> Adapter:
    """The adapter at ``path`` on the CPU, as ``pipeline_class.load_lora_weights`` would read it."""
    file = weight_file(path)
    reader = pipeline_class.lora_state_dict
    params = inspect.signature(reader).parameters
    alphas = None
    if "return_alphas" in params:  # FLUX: kohya-style files carry per-module alphas
        state_dict, alphas, metadata = reader(
            str(file.parent), weight_name=file.name, return_alphas=True, return_lora_metadata=True
        )
    else:
        state_dict, metadata = reader(str(file.parent), weight_name=file.name, return_lora_metadata=True)
    adapter = from_state_dict(name, {k: v for k, v in state_dict.items()}, metadata, alphas)
    adapter.source = str(file)
    return adapter
