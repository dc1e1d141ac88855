"""Quality-regression reports: does an acceleration change what the model draws, and by how much?

``triptych quality [--model DIR] --teacache-threshold 0.1 0.2 [--images 32] [--min-psnr 30]``
runs the same requests (prompt, seed, size, steps) through the plain path and through each
acceleration setting, in one process on the same weights, and reports per setting:

- fidelity to the plain image: PSNR and SSIM (torchmetrics), mean and worst;
- how much work was skipped (TeaCache rows served from the cache / rows);
- prompt adherence on both sides, where the model draws the project's shape world (the packaged
  default model; ``triptych.json`` ``"world": "shapes"``): the held-out prompts are read back from
  pixels by ``triptych.world.score`` (shape, colour, background all right), so an acceleration that
  keeps PSNR but breaks what was asked for shows up.

Gates (``--min-psnr``, ``--max-adherence-drop``) make it a check: the command exits 1 when a
setting falls below them, so a CI job can hold an acceleration to a stated tolerance. The plain
path runs the CFG branches as the serving engine does (fused), with threshold 0, which is
bit-identical to no TeaCache at all (``tests/pipelines/test_teacache_*``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from triptych.calibration.metrics import psnr, ssim
from triptych.errors import InvalidParam

WORLD_KEYS = ("shape", "color", "background")


@dataclass
class SettingReport:
    """One acceleration setting against the plain path, over every request of the report."""

    teacache_threshold: float
    images: int
    identical: int  # images bit-identical to the plain one (their PSNR is infinite)
    psnr_mean: float  # dB, over the images that differ; inf when none does
    psnr_min: float
    ssim_mean: float
    ssim_min: float
    skipped_fraction: float  # transformer rows served from the cache / rows
    adherence: float | None  # share of images with every world attribute right; None off-world
    plain_adherence: float | None
    seconds: float  # wall time of this setting's generations (information, not a claim)
    failures: list[str] = field(default_factory=list)  # gates this setting failed


def _is_world_model(model_dir: Path) -> bool:
    from triptych.pipelines.geometry import model_defaults

    return model_defaults(model_dir).get("world") == "shapes"


def world_prompts(model_dir: str | Path, n: int = 4) -> list[str] | None:
    """Calibration prompts for a shape-world model (train-split captions, never the held-out ones a
    quality report scores), or None for any other model."""
    if not _is_world_model(Path(model_dir)):
        return None
    from triptych.world import caption, sample_scenes

    return [caption(s, "short") for s in sample_scenes(n, "calibrate", "train")]


def _requests(images: int, steps: int | None, world: bool, prompts):
    from triptych.pipelines.base import GenerationParams

    if world:
        from triptych.world import caption, sample_scenes

        scenes = sample_scenes(images, "quality", "heldout")
        return [(GenerationParams(prompt=caption(s, "short"), seed=i, steps=steps), s) for i, s in enumerate(scenes)]
    from triptych.calibration.collect import DEFAULT_PROMPTS

    prompts = list(prompts or DEFAULT_PROMPTS)
    return [(GenerationParams(prompt=prompts[i % len(prompts)], seed=i, steps=steps), None) for i in range(images)]


def _fidelity(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    return psnr(got, want), ssim(got, want)


def quality_report(
    model_dir: str | Path,
    thresholds: list[float],
    images: int = 32,
    steps: int | None = None,
    world: bool | None = None,
    prompts: list[str] | None = None,
    profiles_dir: str | Path | None = None,
    min_psnr: float | None = None,
    max_adherence_drop: float | None = None,
    device="cpu",
) -> dict[str, Any]:
    """Plain vs each TeaCache threshold on the same requests; see the module docstring. ``device``: a
    device name or ``triptych.devices.DeviceConfig``."""
    from triptych.pipelines.registry import load_family
    from triptych.pipelines.runner import run_request
    from triptych.pipelines.teacache import check_teacache, make_teacache

    model_dir = Path(model_dir)
    if images < 1:
        raise InvalidParam("images", images, "must be >= 1")
    if not thresholds or any(not (0 < t <= 2) for t in thresholds):
        raise InvalidParam("teacache_threshold", thresholds, "give one or more thresholds in (0, 2]")
    family = load_family(model_dir, device=device)
    world = _is_world_model(model_dir) if world is None else world
    requests = [(family.resolve(p), scene) for p, scene in _requests(images, steps, world, prompts)]
    for t in thresholds:  # fail before any compute when a threshold has no profile for these steps
        check_teacache(family, requests[0][0].replace(teacache_threshold=t), profiles_dir)
    cache = make_teacache(family, profiles_dir)

    def run(params, threshold: float) -> np.ndarray:
        frames, _ = run_request(family, params.replace(teacache_threshold=threshold), f"q-{threshold}", accel=cache)
        return frames.array

    def adherence(arrays) -> float | None:
        if not world:
            return None
        from triptych.world import score

        ok = [
            all(score((a[0] * 255).round().astype("uint8"), s)[k] for k in WORLD_KEYS)
            for a, (_, s) in zip(arrays, requests)
        ]
        return sum(ok) / len(ok)

    t0 = time.perf_counter()
    plain = [run(p, 0.0) for p, _ in requests]
    plain_seconds = time.perf_counter() - t0
    plain_adherence = adherence(plain)
    settings = []
    for t in thresholds:
        before = (cache.stats.rows_skipped, cache.stats.rows_computed)
        t0 = time.perf_counter()
        got = [run(p, t) for p, _ in requests]
        seconds = time.perf_counter() - t0
        skipped = cache.stats.rows_skipped - before[0]
        computed = cache.stats.rows_computed - before[1]
        pairs = [_fidelity(g, w) for g, w in zip(got, plain)]
        psnrs, ssims = [p for p, _ in pairs], [s for _, s in pairs]
        finite = [p for p in psnrs if math.isfinite(p)]
        row = SettingReport(
            teacache_threshold=t,
            images=len(got),
            identical=len(psnrs) - len(finite),
            psnr_mean=float(np.mean(finite)) if finite else math.inf,
            psnr_min=min(psnrs),
            ssim_mean=float(np.mean(ssims)),
            ssim_min=min(ssims),
            skipped_fraction=skipped / max(1, skipped + computed),
            adherence=adherence(got),
            plain_adherence=plain_adherence,
            seconds=seconds,
        )
        if min_psnr is not None and row.psnr_min < min_psnr:
            row.failures.append(f"worst PSNR {row.psnr_min:.2f} dB < {min_psnr} dB")
        drop = None if row.adherence is None else plain_adherence - row.adherence
        if max_adherence_drop is not None and drop is not None and drop > max_adherence_drop:
            row.failures.append(
                f"adherence {row.adherence:.0%} is {drop:.0%} below plain {plain_adherence:.0%} "
                f"(allowed: {max_adherence_drop:.0%})"
            )
        settings.append(row)
    p0 = requests[0][0]
    return {
        "model": str(model_dir),
        "family": family.name,
        "world": world,
        "images": len(requests),
        "steps": p0.steps,
        "size": f"{p0.width}x{p0.height}",
        "guidance": p0.guidance,
        "plain_seconds": plain_seconds,
        "plain_adherence": plain_adherence,
        "settings": [asdict(s) for s in settings],
        "passed": not any(s.failures for s in settings),
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table (what the CLI prints)."""
    head = (
        f"{report['family']} at {report['size']}, {report['steps']} steps, guidance {report['guidance']}, "
        f"{report['images']} requests ({'held-out shape-world prompts' if report['world'] else 'generic prompts'}); "
        f"plain path {report['plain_seconds']:.1f} s"
    )
    columns = (
        "TeaCache threshold",
        "skipped",
        "identical",
        "PSNR mean / worst dB",
        "SSIM mean / worst",
        "adherence plain → cached",
        "s",
        "gates",
    )
    lines = [head, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for s in report["settings"]:
        adh = "n/a" if s["adherence"] is None else f"{s['plain_adherence']:.0%} → {s['adherence']:.0%}"
        gates = "; ".join(s["failures"]) or "pass"
        lines.append(
            f"| {s['teacache_threshold']:g} | {s['skipped_fraction']:.0%} | {s['identical']}/{s['images']} "
            f"| {s['psnr_mean']:.1f} / {s['psnr_min']:.1f} "
            f"| {s['ssim_mean']:.3f} / {s['ssim_min']:.3f} | {adh} | {s['seconds']:.1f} | {gates} |"
        )
    return "\n".join(lines)


def write(report: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(report) + "\n" if out.suffix == ".md" else json.dumps(report, indent=2, default=str) + "\n"
    out.write_text(text)
    return out
