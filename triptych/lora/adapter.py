"""A LoRA adapter as tensors: per target module its down (A) and up (B) matrices and its scale.

The state dicts are diffusers' LoRA format, as a family's pipeline class ``lora_state_dict`` returns
them (it also converts the non-diffusers formats diffusers knows): keys
``<component>.<module>.lora_A.weight`` (rank × in) and ``...lora_B.weight`` (out × rank), the
component ``transformer`` or, where the family's format carries it, ``text_encoder``
(``triptych.lora.formats``); an ``Adapter`` holds one component's modules. The scale
of a module is PEFT's ``lora_alpha / r``: from the file's ``lora_adapter_metadata`` (``lora_alpha``,
``alpha_pattern``, ``use_rslora``), from ``network_alphas`` (FLUX's kohya-style files), else 1 (the
diffusers convention ``alpha == rank`` for a file that carries no alpha).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from triptych.lora.formats import LoraFormat
from triptych.lora.paths import LoraFormatError


@dataclass
class LoraModule:
    """One adapted ``nn.Linear``: ``delta(x) = scale * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # (rank, in_features)
    b: torch.Tensor  # (out_features, rank)
    scale: float  # PEFT's scaling: lora_alpha / r (before a request's own scale)

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class Adapter:
    """A loaded adapter: name → module deltas. Owns its tensors (the store frees it by dropping it)."""

    name: str
    modules: dict[str, LoraModule]
    source: str = ""  # where it was read from (messages)
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def to(self, device: torch.device, dtype: torch.dtype) -> Adapter:
        mods = {k: LoraModule(m.a.to(device, dtype), m.b.to(device, dtype), m.scale) for k, m in self.modules.items()}
        return Adapter(self.name, mods, self.source, self.meta)


def _pattern_value(module: str, patterns: dict, default):
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: an exact module name or a dotted suffix."""
    for pat, value in patterns.items():
        if module == pat or module.endswith("." + pat):
            return value
    return default


def from_state_dict(
    name: str,
    state_dict: dict[str, torch.Tensor],
    metadata: dict | None = None,
    network_alphas: dict | None = None,
    component: str = "transformer",
    fmt: LoraFormat = LoraFormat(),
) -> Adapter:
    """The ``component`` part of a diffusers-format LoRA state dict (its ``<component>.*`` keys) as an
    ``Adapter``; empty when the file adapts only other components. Every key is checked: one of a
    component ``fmt`` does not apply, a non-lora_A/B key or a module without its pair refuses the file."""
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        refusal = fmt.refusal(key)
        if refusal is not None:
            raise LoraFormatError(f"adapter {name!r}: {refusal}")
        part_of, _, rest = key.partition(".")
        module, _, part = rest.rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise LoraFormatError(f"adapter {name!r}: key {key!r} is not a lora_A/lora_B weight (DoRA, bias: no)")
        pairs.setdefault((part_of, module), {})[part[0]] = tensor
    if not pairs:
        raise LoraFormatError(f"adapter {name!r}: no LoRA weights in it")
    modules = {}
    for (part_of, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            where = f"{part_of}.{module}"
            raise LoraFormatError(f"adapter {name!r}: module {where!r} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraFormatError(
                f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: "
                "want (rank, in) and (out, rank)"
            )
        if part_of == component:
            modules[module] = LoraModule(
                a.contiguous(), b.contiguous(), _scale(module, a.shape[0], component, metadata, network_alphas)
            )
    meta = _component(metadata, component)
    return Adapter(name, modules, meta=meta if "lora_alpha" in meta else {})


def _component(values: dict | None, component: str) -> dict:
    """The ``component.``-prefixed entries of ``values``, unprefixed (as diffusers reads metadata)."""
    prefix = component + "."
    return {k[len(prefix) :]: v for k, v in (values or {}).items() if k.startswith(prefix)}


def _scale(module: str, rank: int, component: str, metadata: dict | None, network_alphas: dict | None) -> float:
    meta = _component(metadata, component)
    if "lora_alpha" in meta:
        alpha = float(_pattern_value(module, meta.get("alpha_pattern") or {}, meta["lora_alpha"]))
        return alpha / math.sqrt(rank) if meta.get("use_rslora") else alpha / rank
    alphas = {k.removesuffix(".alpha"): float(v) for k, v in _component(network_alphas, component).items()}
    return alphas[module] / rank if module in alphas else 1.0


def check_fits(adapter: Adapter, shapes: dict[str, tuple[int, int]], model: str = "the model") -> None:
    """Raise ``LoraFormatError`` unless every module is a Linear of ``model`` with matching shapes.
    ``shapes``: module name → ``(out_features, in_features)``."""
    for module, m in adapter.modules.items():
        if module not in shapes:
            raise LoraFormatError(f"adapter {adapter.name!r}: module {module!r} is not a Linear layer of {model}")
        out_f, in_f = shapes[module]
        if m.a.shape[1] != in_f or m.b.shape[0] != out_f:
            raise LoraFormatError(
                f"adapter {adapter.name!r}: module {module!r} is ({out_f} out, {in_f} in) in {model}, but the "
                f"adapter has lora_A {tuple(m.a.shape)} and lora_B {tuple(m.b.shape)} "
                f"(want ({m.rank}, {in_f}) and ({out_f}, {m.rank}))"
            )


def linear_shapes(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Every ``nn.Linear`` under ``module``: name → ``(out_features, in_features)``."""
    return {n: (m.out_features, m.in_features) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
