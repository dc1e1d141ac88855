"""Random LoRA adapters in diffusers' format, for tests and benchmarks (no trained adapter ships).

``write_random_lora`` saves ``pytorch_lora_weights.safetensors`` through the pipeline class's own
``save_lora_weights`` (keys ``transformer.<module>.lora_{A,B}.weight``, with a ``text_encoder`` also
``text_encoder.<module>.lora_{A,B}.weight`` where the class saves text-encoder LoRA (FLUX), and, with
``alpha``, the ``lora_adapter_metadata`` PEFT's config reads), so ``load_lora_weights`` reads it as
any adapter. Unlike a freshly initialised PEFT adapter, B is not zero: the adapter changes the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def write_random_lora(
    out: str | Path,
    transformer: torch.nn.Module | None,
    targets: Sequence[str],
    rank: int,
    seed: int,
    alpha: float | None = None,
    std: float = 0.05,
    pipeline_class=None,
    text_encoder: torch.nn.Module | None = None,
    text_encoder_targets: Sequence[str] = (),
) -> Path:
    """Write an adapter for every Linear of ``transformer`` whose name ends with one of ``targets``
    and, with ``text_encoder``, every Linear of it whose name ends with one of ``text_encoder_targets``
    (``transformer`` None: a text-encoder-only adapter)."""
    from diffusers import QwenImagePipeline

    pipeline_class = pipeline_class or QwenImagePipeline
    gen = torch.Generator().manual_seed(seed)
    kwargs = {}
    for part, module, wanted in (
        ("transformer", transformer, targets),
        ("text_encoder", text_encoder, text_encoder_targets),
    ):
        if module is None:
            continue
        layers, names = _random_layers(module, wanted, rank, std, gen)
        kwargs[f"{part}_lora_layers"] = layers
        kwargs[f"{part}_lora_adapter_metadata"] = (
            None if alpha is None else {"r": rank, "lora_alpha": alpha, "target_modules": names}
        )
    pipeline_class.save_lora_weights(str(out), **kwargs)
    return Path(out)


def _random_layers(module: torch.nn.Module, targets: Sequence[str], rank: int, std: float, gen: torch.Generator):
    layers, names = {}, []
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            names.append(name)
            layers[f"{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=gen) * std
            layers[f"{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=gen) * std
    assert names, f"no Linear matches {list(targets)}"
    return layers, names
