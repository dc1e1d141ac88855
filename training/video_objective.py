"""The video model's training objective: the rectified-flow loss and the text encoder's identity loss.

Identity loss (training only, never exported): a linear head reads the mean of a caption's prompt
embeddings (its tokens' last hidden states, padding left out) and must name the clip's shape, colour,
background and direction (cross-entropy per field, averaged). The shipped model's text encoder put
prompts differing only in the shape word no further apart than its random twin, so the transformer
could not read the shape kind from the prompt; the head makes the embeddings carry every field.
"""

from __future__ import annotations

import torch

from shapeworld import COLOR_NAMES, SHAPES
from shapeworld.video import DIRECTIONS, Clip
from training.dit_objective import _sigmas

#: The fields the identity head names, and their values (the label is the index).
IDENTITY_FIELDS: dict[str, tuple[str, ...]] = {
    "shape": SHAPES,
    "color": COLOR_NAMES,
    "background": COLOR_NAMES,
    "direction": tuple(DIRECTIONS),
}


def identity_labels(clips: list[Clip]) -> torch.Tensor:
    """``(N, fields)`` long: each clip's index in each field of :data:`IDENTITY_FIELDS`."""
    return torch.tensor([[values.index(getattr(c, f)) for f, values in IDENTITY_FIELDS.items()] for c in clips])


class IdentityHead(torch.nn.Module):
    """One linear layer from the pooled prompt embedding to every field's logits."""

    def __init__(self, dim: int):
        super().__init__()
        self.sizes = [len(v) for v in IDENTITY_FIELDS.values()]
        self.linear = torch.nn.Linear(dim, sum(self.sizes))

    def forward(self, embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over fields; ``embeds`` are zero-padded ``(N, L, D)`` prompt embeddings."""
        valid = embeds.abs().sum(-1, keepdim=True).gt(0).float()
        pooled = (embeds * valid).sum(1) / valid.sum(1).clamp(min=1)
        logits = self.linear(pooled).split(self.sizes, dim=-1)
        return torch.stack([torch.nn.functional.cross_entropy(z, labels[:, k]) for k, z in enumerate(logits)]).mean()


def flow_loss(transformer, x0, embeds, weight, gen, high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted mean squared error of the predicted ``e - x0`` at ``x_s = (1 - s) x0 + s e``, the
    one-step x0 prediction ``x_s - s * pred`` (with gradients) and each clip's ``s``."""
    s = _sigmas(gen, x0.shape[0], high)
    noise = torch.randn(x0.shape, generator=gen)
    sv = s.view(-1, 1, 1, 1, 1)
    xs = (1 - sv) * x0 + sv * noise
    pred = transformer(hidden_states=xs, timestep=s * 1000, encoder_hidden_states=embeds, return_dict=False)[0]
    err = (pred - (noise - x0)).pow(2).mean(1, keepdim=True)
    return (err * weight).sum() / weight.sum(), xs - sv * pred, s
