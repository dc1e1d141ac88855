"""Image fidelity of one output against another: PSNR and SSIM (torchmetrics), computed in float64.

Every PSNR and SSIM figure of the project (the quality report, the tests' tolerances, the benchmark
tables) comes from these two functions, so they all measure the same quantity. Inputs are numpy
arrays or tensors, e.g. ``Frames.array`` (frames, H, W, 3) in [0, 1], or uint8 pixels with
``data_range=255``. torchmetrics is imported on first use (it takes seconds to import).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _double(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.array(x, dtype=np.float64))  # a copy: decoded images may be read-only


def psnr(got: np.ndarray | torch.Tensor, want: np.ndarray | torch.Tensor, data_range: float = 1.0) -> float:
    """PSNR in dB of ``got`` against ``want`` over all their elements (same shape); inf when identical."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    a, b = _double(got), _double(want)
    if a.shape != b.shape:
        raise ValueError(f"psnr: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    if torch.equal(a, b):
        return math.inf
    return float(peak_signal_noise_ratio(a, b, data_range=data_range))


def ssim(
    got: np.ndarray | torch.Tensor,
    want: np.ndarray | torch.Tensor,
    data_range: float = 1.0,
    channels_last: bool = True,
) -> float:
    """Mean SSIM of two image batches, (N, H, W, C) (or (N, C, H, W) with ``channels_last=False``);
    1.0 when identical."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    a, b = _double(got), _double(want)
    if a.shape != b.shape or a.ndim != 4:
        raise ValueError(f"ssim: two (N, H, W, C) / (N, C, H, W) batches, got {tuple(a.shape)} vs {tuple(b.shape)}")
    if torch.equal(a, b):
        return 1.0
    if channels_last:
        a, b = a.permute(0, 3, 1, 2), b.permute(0, 3, 1, 2)
    return float(structural_similarity_index_measure(a, b, data_range=data_range))
