"""The transformer's training objective and its small helpers: noise levels, token weights, the
rectified-flow loss, EMA, padding of prompt embeddings, progress lines."""

from __future__ import annotations

import logging

import torch

from training import data

logger = logging.getLogger("training.dit")


def _ema(ema, model, step: int) -> None:
    decay = min(0.999, (1 + step) / (10 + step))
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - decay)


def _log(step, steps, loss_t, loss_e, timer, every) -> None:
    if step % every == 0 or step == steps - 1:
        logger.info(
            "dit step %d/%d loss t2i %.4f edit %.4f (%.0fs)", step, steps, loss_t.item(), loss_e.item(), timer()
        )


def _pad(embeds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(e.shape[0] for e in embeds)
    out = torch.zeros(len(embeds), n, embeds[0].shape[1])
    mask = torch.zeros(len(embeds), n, dtype=torch.long)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return out, mask


def _sigmas(gen: torch.Generator, n: int, high: float = 0.0) -> torch.Tensor:
    """Half uniform, half logit-normal; with ``high`` > 0 that share is instead drawn from U(0.8, 1)."""
    uniform = torch.rand(n, generator=gen)
    logit = torch.sigmoid(torch.randn(n, generator=gen))
    pick = torch.rand(n, generator=gen) < 0.5
    s = torch.where(pick, uniform, logit)
    if high > 0:
        top = 0.8 + 0.2 * torch.rand(n, generator=gen)
        s = torch.where(torch.rand(n, generator=gen) < high, top, s)
    return s.clamp(1e-3, 1.0)


def token_foreground(scenes, patch: int = 16) -> torch.Tensor:
    """(N, tokens) 1.0 where a 2x2-latent token's pixels (``patch`` px square) touch the shape."""
    mask = data.shape_mask(data.pixels(scenes)[:, :, 0])  # (N, 1, H, W)
    return torch.nn.functional.max_pool2d(mask, patch).flatten(1)


def flow_loss(model, x0, embeds, mask, shapes, gen, extra=None, high: float = 0.0, weight=None) -> torch.Tensor:
    """Mean squared flow error; ``weight`` (rows, tokens) weights each image token's error."""
    s = _sigmas(gen, x0.shape[0], high)
    noise = torch.randn(x0.shape, generator=gen)
    xt = (1 - s.view(-1, 1, 1)) * x0 + s.view(-1, 1, 1) * noise
    hidden = xt if extra is None else torch.cat([xt, extra], dim=1)
    pred = model(
        hidden_states=hidden,
        timestep=s,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=mask,
        img_shapes=[shapes] * x0.shape[0],
        return_dict=False,
    )[0][:, : x0.shape[1]]
    if weight is None:
        return (pred - (noise - x0)).pow(2).mean()
    return ((pred - (noise - x0)).pow(2).mean(-1) * weight).sum() / weight.sum()
