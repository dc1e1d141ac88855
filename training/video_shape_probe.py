"""A shape-kind probe on video latents, and the transformer's shape loss through it (training only).

The video model's misses are shapes drawn halfway between a circle and a square: the flow loss is an
L2 loss, and a blob between the two outlines costs it little. The probe is a small convolutional
classifier that names a frame's shape kind from its normalised VAE latents (position-invariant: a
global max over the 8x8 grid); it is trained on the train clips' latents (with noise, as the
transformer's predictions are never clean) and then frozen. During the transformer's phase with
``shape`` > 0, each named caption's clip gets the probe's cross-entropy on the one-step x0
prediction ``x_s - s * v`` of every frame: an in-between blob is now wrong for either name.
Never exported.
"""

from __future__ import annotations

import logging

import torch

from shapeworld import SHAPES

logger = logging.getLogger("training.video_shape_probe")


class ShapeProbe(torch.nn.Module):
    def __init__(self, channels: int = 16, width: int = 48):
        super().__init__()
        act = torch.nn.GELU
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(channels, width, 3, padding=1),
            act(),
            torch.nn.Conv2d(width, width, 3, padding=1),
            act(),
            torch.nn.Conv2d(width, width, 3, padding=1),
            act(),
        )
        self.head = torch.nn.Linear(width, len(SHAPES))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """``(N, C, F, h, w)`` latents -> ``(N * F, shapes)`` logits, one row per frame."""
        frames = latents.transpose(1, 2).flatten(0, 1)
        return self.head(self.net(frames).amax((2, 3)))


def frame_labels(shapes: list[str], frames: int) -> torch.Tensor:
    """Each clip's shape index repeated for its frames, matching :meth:`ShapeProbe.forward`'s rows."""
    return torch.tensor([SHAPES.index(s) for s in shapes]).repeat_interleave(frames)


def shape_loss(probe: ShapeProbe, x0_pred: torch.Tensor, shapes: list[str], keep: torch.Tensor | None = None):
    """Mean cross-entropy over the frames of ``x0_pred``; ``keep`` (bool per clip): only those clips'."""
    frames = x0_pred.shape[2]
    if keep is None:
        return torch.nn.functional.cross_entropy(probe(x0_pred), frame_labels(shapes, frames))
    if not bool(keep.any()):
        return x0_pred.sum() * 0.0
    kept = [s for s, k in zip(shapes, keep.tolist()) if k]
    return torch.nn.functional.cross_entropy(probe(x0_pred[keep]), frame_labels(kept, frames))


def train_probe(x0: torch.Tensor, shapes: list[str], seed: int, steps: int = 800, batch: int = 64) -> ShapeProbe:
    """Fit on ``x0`` (the train clips' normalised latents) with noise of a random scale in [0, 0.6];
    logs the accuracy on the last tenth of the clips (left out of the fit) at noise 0 and 0.3."""
    gen = torch.Generator().manual_seed(seed + 7)
    order = torch.randperm(len(x0), generator=gen)
    cut = len(x0) * 9 // 10
    fit, check = order[:cut], order[cut:]
    torch.manual_seed(seed + 7)
    probe = ShapeProbe(x0.shape[1])
    opt = torch.optim.AdamW(probe.parameters(), lr=2e-3, weight_decay=0.0)
    for _ in range(steps):
        idx = fit[torch.randint(len(fit), (batch,), generator=gen)]
        scale = 0.6 * torch.rand(batch, 1, 1, 1, 1, generator=gen)
        x = x0[idx] + scale * torch.randn(x0[idx].shape, generator=gen)
        loss = shape_loss(probe, x, [shapes[i] for i in idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    probe.eval().requires_grad_(False)
    with torch.no_grad():
        labels = frame_labels([shapes[i] for i in check], x0.shape[2])
        for noise in (0.0, 0.3):
            x = x0[check] + noise * torch.randn(x0[check].shape, generator=gen)
            acc = (probe(x).argmax(-1) == labels).float().mean().item()
            logger.info("shape probe: frame accuracy %.3f at noise %.1f on %d left-out clips", acc, noise, len(check))
    return probe
