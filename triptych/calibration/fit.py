"""Fit TeaCache's rescaling polynomial, sweep thresholds, recommend one and write a profile file
(format: ``triptych.accel.teacache_profile``).

``triptych calibrate --model MODEL_DIR --steps 28``:

1. collects reference trajectories (``collect.py``) on the *fit set* (prompts × seeds) and fits
   ``output_rel ≈ polyval(coefficients, input_rel)`` with ``numpy.polyfit`` at degree 4, over both
   CFG branches; each branch's own fit is reported beside the joint one (``quality.branches``), so
   the profile shows whether one polynomial serves both;
2. sweeps thresholds (``sweep.py``) on the *evaluation set*: other prompts and other seeds than the
   fit's, so the recommendation is measured on requests the fit never saw;
3. writes ``MODEL_DIR/teacache/<family>-<steps>steps.json`` (or ``--out``) with the fit figures, the
   sweep table and the recommendation (what ``"auto"`` means).

Seeds: the fit uses 1000, 1001 and the evaluation 2000, 2001, ... by default, and ``triptych
quality`` draws seeds from 0 with held-out shape-world prompts, so a quality report checks the
recommendation on prompts and seeds calibration never saw.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from triptych.accel.teacache_profile import (
    DEGREE,
    PROFILE_FORMAT,
    PROFILED_COMPONENTS,
    TeaCacheProfile,
    profile_filename,
    save_profile,
)
from triptych.calibration.collect import DEFAULT_PROMPTS, Trajectory, collect
from triptych.calibration.sweep import recommend, sweep, table_markdown
from triptych.calibration.target import FIT_SEEDS, Target
from triptych.core.identity import model_identity

logger = logging.getLogger(__name__)

EVAL_SEED_BASE = 2000
#: Generic evaluation prompts (models outside the shape world), disjoint from ``DEFAULT_PROMPTS``.
EVAL_PROMPTS = (
    "a sailing boat on a calm lake at sunset",
    "a cup of coffee next to an open book",
    "a snowy mountain village at night",
    "a close-up of a green parrot",
)


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
    quality["per_branch"] = branch_figures(trajectories, coeffs)
    return TeaCacheProfile(family, model, steps, tuple(coeffs), warmup, cooldown, quality)


def branch_figures(trajectories: Sequence[Trajectory], joint: Sequence[float]) -> dict:
    """Per CFG branch: r2 / rmse of the joint polynomial on that branch's points, and of a fit made
    on that branch alone. Close figures mean one fit serves both branches."""
    out = {}
    for branch in sorted({t.branch for t in trajectories}):
        x = np.array([v for t in trajectories if t.branch == branch for v in t.input_rel])
        y = np.array([v for t in trajectories if t.branch == branch for v in t.output_rel])
        pred = np.polyval(joint, x)
        ss_tot = float(((y - y.mean()) ** 2).sum())
        joint_r2 = 1 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        try:
            _, own = fit_coefficients(x, y)
        except ValueError:
            own = {"r2": None, "rmse": None}
        out[branch] = {
            "points": int(len(x)),
            "joint_r2": joint_r2,
            "joint_rmse": float(np.sqrt(((y - pred) ** 2).mean())),
            "own_r2": own["r2"],
            "own_rmse": own["rmse"],
        }
    return out


def eval_requests(model_dir, n: int, fit_prompts: Sequence[str], base):
    """``n`` evaluation requests (params, scene or None): prompts not in the fit set, seeds from
    ``EVAL_SEED_BASE``. Shape-world models use train-split captions (held-out combinations are left to
    ``triptych quality``), clips for the moving shape world (``clips.eval_clips``)."""
    from triptych.calibration.clips import caption, eval_clips, is_video_world
    from triptych.calibration.quality import _is_world_model

    seeds = [EVAL_SEED_BASE + i for i in range(n)]
    if is_video_world(model_dir):
        clips = eval_clips(n, fit_prompts)
        return [(base.replace(prompt=caption(c), seed=seed), c) for c, seed in zip(clips, seeds)]
    if _is_world_model(Path(model_dir)):
        from shapeworld import caption, sample_scenes

        scenes = [s for s in sample_scenes(4 * n + 8, "calibrate-eval", "train") if caption(s) not in fit_prompts]
        scenes = scenes[:n]
        return [(base.replace(prompt=caption(s), seed=seed), s) for s, seed in zip(scenes, seeds)]
    prompts = [p for p in EVAL_PROMPTS if p not in fit_prompts] or list(EVAL_PROMPTS)
    return [(base.replace(prompt=prompts[i % len(prompts)], seed=seed), None) for i, seed in enumerate(seeds)]


def calibrate(
    model_dir: str | Path,
    steps: int,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    seeds: Sequence[int] = FIT_SEEDS,
    out: str | Path | None = None,
    family=None,
    device="cpu",
    warmup: int = 1,
    cooldown: int = 1,
    thresholds: Sequence[float] = (),
    variants: Sequence[tuple[int, int | None, int]] | None = None,
    eval_images: int = 16,
    target: Target | None = None,
    batch_size: int = 8,
    report_dir: str | Path | None = None,
    progress: bool = False,
    profiles_dir: str | Path | None = None,
    **base,
) -> tuple[TeaCacheProfile, Path]:
    """Collect, fit, sweep, recommend and write; returns the profile and its path.

    ``variants``: (warmup, max_skips, forecast) triples swept with every threshold (default:
    ``[(warmup, None, 0)]``); the recommended one's warmup, cap and forecast become the profile's. ``thresholds=()`` fits only (no
    recommendation). The profile goes to ``out``, else ``profiles_dir/<family>-<steps>steps.json``
    (the CLI's user directory), else ``model_dir/teacache/``; never into the installed package
    (``save_profile`` refuses). ``base``: other GenerationParams fields (size, guidance, image). ``device``: a
    device name or ``triptych.core.devices.DeviceConfig`` for the family loaded here.
    """
    from triptych.accel.teacache import TeaCache
    from triptych.calibration.batch import Cases
    from triptych.families.base import GenerationParams, Role
    from triptych.families.registry import load_family

    family = family or load_family(model_dir, roles=(Role.ENCODER, Role.DENOISER, Role.DECODER), device=device)
    base_params = GenerationParams(prompt="-", steps=steps, **base)
    trajectories = collect(family, steps, prompts, seeds, base=base_params)
    model = model_identity(model_dir, PROFILED_COMPONENTS)
    profile = build_profile(family.name, model, steps, trajectories, warmup, cooldown)
    target = target or Target()
    result = None
    if thresholds:
        requests = eval_requests(model_dir, eval_images, list(prompts), base_params)
        cases = Cases(family, [p for p, _ in requests])
        scenes = [s for _, s in requests] if requests[0][1] is not None else None
        variants = list(variants or [(warmup, None, 0)])
        plan = family.teacache_plan()
        bar = _bar(progress, len(cases) * (1 + len(thresholds) * len(variants)), "calibrate sweep")
        result = sweep(
            lambda p: TeaCache(plan, profiles=lambda n: p),
            profile,
            cases,
            thresholds,
            variants,
            scenes,
            target,
            batch_size,
            bar.update if bar else None,
        )
        if bar:
            bar.close()
        chosen = recommend(result.rows)
        profile = _with_sweep(profile, result.rows, chosen, target, requests)
        logger.info("calibration sweep:\n%s", table_markdown(result.rows, chosen))
    directory = Path(profiles_dir) if profiles_dir is not None else Path(model_dir) / "teacache"
    path = Path(out) if out else directory / profile_filename(family.name, steps)
    save_profile(profile, path)
    if report_dir is not None:
        from triptych.calibration.report_calibrate import write_calibration_report

        write_calibration_report(report_dir, profile, trajectories, result)
    logger.info("TeaCache profile %s (%s): r2=%.4f", path, PROFILE_FORMAT, profile.quality["r2"])
    return profile, path


def _with_sweep(profile: TeaCacheProfile, rows, chosen, target: Target, requests) -> TeaCacheProfile:
    import dataclasses

    table = [{k: v for k, v in r.items() if k != "psnr_each"} for r in rows]
    sweep_info = {
        "prompts": [p.prompt for p, _ in requests],
        "seeds": [p.seed for p, _ in requests],
        "rows": table,
        "recommended_row": None if chosen is None else rows.index(chosen),
    }
    if chosen is None:
        return dataclasses.replace(profile, target=dataclasses.asdict(target), sweep=sweep_info)
    return dataclasses.replace(
        profile,
        warmup=chosen["warmup"],
        max_skips=chosen["max_skips"],
        forecast=chosen["forecast"],
        recommended_threshold=chosen["threshold"],
        target=dataclasses.asdict(target),
        sweep=sweep_info,
    )


def _bar(on: bool, total: int, desc: str):
    if not on:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="image", file=sys.stderr)
