"""Reading adapter files: a folder (diffusers' ``pytorch_lora_weights.safetensors``, or its only
``.safetensors`` file) or one ``.safetensors`` file, through the family's own diffusers pipeline class
``lora_state_dict`` (the reader behind ``load_lora_weights``, with its format conversions), so what
diffusers loads for the family is what loads here. Local files only: never a hub name or a URL.

Text-encoder keys (``text_encoder.*``, FLUX's CLIP) get the conversions diffusers' text-encoder
loader applies after ``lora_state_dict`` (older diffusers layouts to PEFT's ``lora_A``/``lora_B``;
the ``text_model.`` prefix dropped for an encoder without that level, as transformers 5's CLIP)."""

from __future__ import annotations

import inspect
from pathlib import Path

from triptych.lora.adapter import Adapter, from_state_dict
from triptych.lora.formats import LoraFormat
from triptych.lora.paths import weight_file


def read_adapter(
    name: str,
    path: str | Path,
    pipeline_class,
    component: str = "transformer",
    fmt: LoraFormat = LoraFormat(),
    flat_text_model: bool = True,
) -> Adapter:
    """The ``component`` part of the adapter at ``path`` on the CPU, as
    ``pipeline_class.load_lora_weights`` would read it. ``flat_text_model``: the text encoder has no
    ``text_model`` level (``text_model.`` is dropped from its keys, as diffusers does)."""
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
    state_dict = text_encoder_keys(dict(state_dict), flat_text_model)
    adapter = from_state_dict(name, state_dict, metadata, alphas, component, fmt)
    adapter.source = str(file)
    return adapter


def text_encoder_keys(state_dict: dict, flat_text_model: bool, prefix: str = "text_encoder") -> dict:
    """``state_dict`` with its ``prefix.*`` keys converted as ``_load_lora_into_text_encoder`` does."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft

    te = {k[len(prefix) + 1 :]: v for k, v in state_dict.items() if k.startswith(prefix + ".")}
    if not te:
        return state_dict
    try:
        te = convert_state_dict_to_peft(convert_state_dict_to_diffusers(te))
    except ValueError:  # a layout neither converts: from_state_dict names the key it cannot apply
        pass
    if flat_text_model:
        te = {k.removeprefix("text_model."): v for k, v in te.items()}
    out = {k: v for k, v in state_dict.items() if not k.startswith(prefix + ".")}
    out.update({f"{prefix}.{k}": v for k, v in te.items()})
    return out
