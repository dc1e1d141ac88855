"""Where a model's roles would go on N equal devices, and the parallel degrees its denoiser would take.

The rule, in order: the encoder and decoder share device 0 with a denoiser rank when all three fit
there, else device 0 is theirs alone; the other devices are denoiser ranks. The ranks of one instance
take CFG parallel 2 when requests run two branches, then the largest Ulysses degree that divides the
attention heads and the ranks left; ranks beyond one instance's degree make more instances."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Placement:
    devices: int
    encoder_decoder_device: int
    shares_with_denoiser: bool  # whether device 0 also holds a denoiser rank
    denoiser_devices: int
    cfg: int
    ulysses: int
    instances: int  # denoiser instances of cfg × ulysses ranks
    fits: bool  # each device holds what is placed on it
    why: str = ""  # what does not fit, when fits is False

    def to_dict(self) -> dict:
        return asdict(self)


def place(
    memory: int,
    devices: int,
    encoder_decoder: int,
    denoiser: int,
    denoiser_activations: int,
    branches: int,
    heads: int,
) -> Placement:
    """``encoder_decoder``: bytes the encoder and decoder need together (weights and activation peak);
    ``denoiser``: the transformer's weight bytes; ``denoiser_activations``: its activation peak for one
    step on one rank holding every row (CFG and Ulysses ranks each hold a share)."""
    share = devices == 1 or encoder_decoder + denoiser + denoiser_activations <= memory
    ranks = devices if share else devices - 1
    cfg = 2 if branches == 2 and ranks >= 2 else 1
    ulysses = max(u for u in range(1, ranks // cfg + 1) if heads % u == 0 and (ranks // cfg) % u == 0) if ranks else 1
    instances = ranks // (cfg * ulysses) if ranks else 0
    per_rank = denoiser + denoiser_activations // (cfg * ulysses)
    why = []
    if ranks == 0:
        why.append("no device left for the denoiser")
    elif per_rank + (encoder_decoder if share else 0) > memory:
        why.append(f"a denoiser rank needs {per_rank / 1e9:.1f} GB")
    if not share and encoder_decoder > memory:
        why.append(f"the encoder and decoder need {encoder_decoder / 1e9:.1f} GB")
    fits = not why
    return Placement(devices, 0, share and ranks > 0, ranks, cfg, ulysses, instances, fits, "; ".join(why))
