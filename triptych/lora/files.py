"""Reading adapter files: a folder (diffusers' ``pytorch_lora_weights.safetensors``, or its only
``.safetensors`` file) or one ``.safetensors`` file, through the family's own diffusers pipeline class
``lora_state_dict`` (the reader behind ``load_lora_weights``, with its format conversions), so what
diffusers loads for the family is what loads here. Local files only: never a hub name or a URL."""

from __future__ import annotations

import inspect
from pathlib import Path

from triptych.lora.adapter import Adapter, from_state_dict
from triptych.lora.paths import weight_file


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
