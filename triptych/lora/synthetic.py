"""Random LoRA adapters in diffusers' format, for tests and benchmarks (no trained adapter ships).

``write_random_lora`` saves ``pytorch_lora_weights.safetensors`` through the pipeline class's own
``save_lora_weights`` (keys ``transformer.<module>.lora_{A,B}.weight`` and, with ``alpha``, the
``lora_adapter_metadata`` PEFT's config reads), so ``load_lora_weights`` reads it as any adapter.
Unlike a freshly initialised PEFT adapter, B is not zero: the adapter changes the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from triptych.lora.adapter import PREFIX


def write_random_lora(
    out: str | Path,
    transformer: torch.nn.Module,
    targets: Sequence[str],
    rank: int,
    seed: int,
    alpha: float | None = None,
    std: float = 0.05,
    pipeline_class=None,
) -> Path:
    """Write an adapter for every Linear of ``transformer`` whose name ends with one of ``targets``."""
    from diffusers import QwenImagePipeline

    pipeline_class = pipeline_class or QwenImagePipeline
    gen = torch.Generator().manual_seed(seed)
    layers = {}
    names = []
    for name, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            names.append(name)
            layers[f"{PREFIX}{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=gen) * std
            layers[f"{PREFIX}{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=gen) * std
    assert names, f"no Linear matches {list(targets)}"
    meta = None
    if alpha is not None:
        meta = {"r": rank, "lora_alpha": alpha, "target_modules": names}
    pipeline_class.save_lora_weights(
        str(out),
        transformer_lora_layers={k[len(PREFIX) :]: v for k, v in layers.items()},
        transformer_lora_adapter_metadata=meta,
    )
    return Path(out)
