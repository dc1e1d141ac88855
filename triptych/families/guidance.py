"""Classifier-free guidance combines, shared by the families (the same ops as their pipelines)."""

from __future__ import annotations

import torch

from triptych.families.base import COND, UNCOND


def cfg_combine(preds: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """``uncond + scale * (cond - uncond)``; the cond prediction alone when CFG is off."""
    pos = preds[COND]
    if UNCOND not in preds:
        return pos
    neg = preds[UNCOND]
    return neg + scale * (pos - neg)


def cfg_combine_norm_rescaled(preds: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """True CFG whose result keeps the cond prediction's per-token norm (Qwen-Image)."""
    comb = cfg_combine(preds, scale)
    if UNCOND not in preds:
        return comb
    cond_norm = torch.norm(preds[COND], dim=-1, keepdim=True)
    noise_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / noise_norm)
