"""The one PSNR/SSIM: torchmetrics in float64, any layout for PSNR, identical inputs exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from triptych.calibration.metrics import psnr, ssim


def images(seed: int = 0, noise: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.random((2, 16, 16, 3)).astype(np.float32)
    return a, np.clip(a + rng.normal(0, noise, a.shape), 0, 1).astype(np.float32)


def test_psnr_is_the_mse_formula():
    a, b = images()
    want = 10 * np.log10(1.0 / np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    assert psnr(a, b) == pytest.approx(want, abs=1e-4)
    u, v = (a * 255).round().astype(np.uint8), (b * 255).round().astype(np.uint8)
    want = 10 * np.log10(255.0**2 / np.mean((u.astype(np.float64) - v.astype(np.float64)) ** 2))
    assert psnr(u, v, data_range=255.0) == pytest.approx(want, abs=1e-4)


def test_identical_inputs_are_infinite_psnr_and_unit_ssim():
    a, _ = images()
    assert psnr(a, a.copy()) == math.inf and ssim(a, a.copy()) == 1.0


def test_arrays_and_tensors_and_layouts_agree():
    a, b = images()
    ta, tb = torch.from_numpy(a).permute(0, 3, 1, 2), torch.from_numpy(b).permute(0, 3, 1, 2)
    assert psnr(ta, tb) == pytest.approx(psnr(a, b), abs=1e-9)
    assert ssim(ta, tb, channels_last=False) == pytest.approx(ssim(a, b), abs=1e-12)
    assert 0 < ssim(a, b) < 1


def test_shape_mismatch_raises():
    a, _ = images()
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(a, a[:1])
    with pytest.raises(ValueError, match="ssim"):
        ssim(a[0], a[0])
