"""LoRA settings: which adapters a deployment serves, the denoiser's memory for them, the scale range."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoraConfig:
    lora: tuple[str, ...] = ()
    """Adapters to serve, each ``NAME=DIR`` (a folder with diffusers' pytorch_lora_weights.safetensors,
    or a .safetensors file); repeat the flag for several. Requests name them in their ``lora`` field."""

    lora_budget_mb: float = 256.0
    """Memory a denoiser keeps adapters in (MiB); unused ones are evicted least recently used first,
    one used by a running request never."""

    lora_max_scale: float = 4.0
    """Largest absolute scale a request may give an adapter."""

    def __post_init__(self) -> None:
        for entry in self.lora:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora={entry!r}: must be NAME=DIR")
        names = [e.partition("=")[0] for e in self.lora]
        if len(set(names)) != len(names):
            raise ValueError(f"lora: adapter names repeat in {names}; give each adapter its own name")
        if self.lora_budget_mb <= 0:
            raise ValueError(f"lora_budget_mb={self.lora_budget_mb}: must be > 0")
        if self.lora_max_scale <= 0:
            raise ValueError(f"lora_max_scale={self.lora_max_scale}: must be > 0")

    @property
    def adapters(self) -> dict[str, Path]:
        """Name → path of every served adapter."""
        return {name: Path(path) for name, _, path in (e.partition("=") for e in self.lora)}

    @property
    def budget_bytes(self) -> int:
        return int(self.lora_budget_mb * (1 << 20))
