"""Fit TeaCache's rescaling polynomial and write a profile file (format: ``triptych.cache.teacache_profile``).

``triptych calibrate --model MODEL_DIR --steps 28`` collects reference trajectories
(``collect.py``), fits ``output_rel ≈ polyval(coefficients, input_rel)`` with ``numpy.polyfit`` at
degree 4, and writes ``MODEL_DIR/teacache/<family>-<steps>steps.json`` (or ``--out``) with the fit's
quality figures.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from triptych.cache.teacache_profile import (
    DEGREE,
    PROFILED_COMPONENTS,
    TeaCacheProfile,
    profile_filename,
    save_profile,
)
from triptych.calibration.collect import DEFAULT_PROMPTS, Trajectory, collect
from triptych.identity import model_identity

logger = logging.getLogger(__name__)


def fit_coefficients(x: Sequence[float], y: Sequence[float], degree: int = DEGREE) -> tuple[list[float], dict]:
    """Least-squares polynomial (highest power first) and its figures: points, r2, rmse, ranges."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < degree + 1 or len(np.unique(x)) < degree + 1:
        raise ValueError(f"need at least {degree + 1} distinct points to fit degree {degree}, got {len(np.unique(x))}")
    coeffs = np.polyfit(x, y, degree)
    pred = np.polyval(coeffs, x)
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    quality = {
        "points": int(len(x)),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "rmse": float(np.sqrt(ss_res / len(x))),
        "max_abs_error": float(np.abs(y - pred).max()),
        "x_range": [float(x.min()), float(x.max())],
        "y_range": [float(y.min()), float(y.max())],
    }
    return [float(c) for c in coeffs], quality


def build_profile(
    family: str, model: str, steps: int, trajectories: Sequence[Trajectory], warmup: int = 1, cooldown: int = 1
) -> TeaCacheProfile:
    x = [v for t in trajectories for v in t.input_rel]
    y = [v for t in trajectories for v in t.output_rel]
    coeffs, quality = fit_coefficients(x, y)
    quality["trajectories"] = len(trajectories)
    quality["prompts"] = sorted({t.prompt for t in trajectories})
    quality["seeds"] = sorted({t.seed for t in trajectories})
    quality["branches"] = sorted({t.branch for t in trajectories})
    return TeaCacheProfile(family, model, steps, tuple(coeffs), warmup, cooldown, quality)


def calibrate(
    model_dir: str | Path,
    steps: int,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    seeds: Sequence[int] = (0, 1),
    out: str | Path | None = None,
    family=None,
    device="cpu",
    warmup: int = 1,
    cooldown: int = 1,
    **base,
) -> tuple[TeaCacheProfile, Path]:
    """Collect, fit and write; returns the profile and its path. ``base``: other GenerationParams fields.
    ``device``: a device name or ``triptych.devices.DeviceConfig`` for the family loaded here."""
    from triptych.pipelines.base import GenerationParams, Role
    from triptych.pipelines.registry import load_family

    family = family or load_family(model_dir, roles=(Role.ENCODER, Role.DENOISER), device=device)
    trajectories = collect(family, steps, prompts, seeds, base=GenerationParams(prompt="-", **base))
    profile = build_profile(
        family.name, model_identity(model_dir, PROFILED_COMPONENTS), steps, trajectories, warmup, cooldown
    )
    path = Path(out) if out else Path(model_dir) / "teacache" / profile_filename(family.name, steps)
    save_profile(profile, path)
    logger.info("TeaCache profile %s: r2=%.4f over %d points", path, profile.quality["r2"], profile.quality["points"])
    return profile, path
