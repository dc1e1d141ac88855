"""Quality-regression reports: does an acceleration change what the model draws, and by how much?

``triptych quality [--model DIR] --teacache-threshold 0.1 0.2 [--images 32] [--min-psnr 30]``
runs the same requests (prompt, seed, size, steps) through the plain path and through each
acceleration setting, in one process on the same weights, and reports per setting:

- fidelity to the plain image: PSNR and SSIM (torchmetrics), mean and worst;
- how much work was skipped (TeaCache rows served from the cache / rows);
- prompt adherence on both sides, where the model draws the project's shape world (the packaged
  default model; ``triptych.json`` ``"world": "shapes"``): the held-out prompts are read back from
  pixels by ``shapeworld.score`` (shape, colour, background all right), so an acceleration that
  keeps PSNR but breaks what was asked for shows up.

Gates (``--min-psnr``, ``--min-ssim``, ``--max-adherence-drop``; on by default in the CLI at the
calibration target: 30 dB, 0.92, 2 points) make it a check: the command exits 1 when a setting falls
below them, so a CI job can hold an acceleration to a stated tolerance. ``--teacache-threshold auto``
is the profile's recommended threshold. Stored baselines (``--save-baseline``/``--baseline``) are
:mod:`triptych.calibration.baseline`. The plain
path runs the CFG branches as the serving engine does (fused), with threshold 0, which is
bit-identical to no TeaCache at all (``tests/pipelines/test_teacache_*``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from triptych.accel.teacache_profile import AUTO_THRESHOLD
from triptych.core.errors import InvalidParam


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
    seconds: float  # denoise wall time of this setting's requests (information, not a claim)
    failures: list[str] = field(default_factory=list)  # gates this setting failed
    auto: bool = False  # the threshold is the profile's recommendation ("auto")
    profile: str | None = None  # the TeaCache profile the threshold ran with (its path)
    forward_reduction: float = 1.0  # transformer rows plain / cached
    denoise_speedup: float = 1.0  # denoise seconds plain / cached, this run
    motion: float | None = None  # moving shape world: share of clips keeping the plain direction and colour
    track_error: float | None = None  # moving shape world: largest centroid drift from the plain clip


def _is_world_model(model_dir: Path) -> bool:
    from triptych.families.geometry import model_defaults

    return model_defaults(model_dir).get("world") == "shapes"


def world_prompts(model_dir: str | Path, n: int = 4) -> list[str] | None:
    """Calibration prompts for a shape-world model, still or moving (train-split captions, never the
    held-out ones a quality report scores), or None for any other model."""
    from triptych.calibration.clips import fit_captions, is_video_world

    if is_video_world(model_dir):
        return fit_captions(n)
    if not _is_world_model(Path(model_dir)):
        return None
    from shapeworld import caption, sample_scenes

    return [caption(s, "short") for s in sample_scenes(n, "calibrate", "train")]


def _requests(images: int, steps: int | None, world: bool, prompts, video: bool = False):
    from triptych.families.base import GenerationParams

    if world and video:
        from triptych.calibration.clips import caption, heldout_clips

        clips = heldout_clips(images)
        return [(GenerationParams(prompt=caption(c), seed=i, steps=steps), c) for i, c in enumerate(clips)]
    if world:
        from shapeworld import caption, sample_scenes

        scenes = sample_scenes(images, "quality", "heldout")
        return [(GenerationParams(prompt=caption(s, "short"), seed=i, steps=steps), s) for i, s in enumerate(scenes)]
    from triptych.calibration.collect import DEFAULT_PROMPTS

    prompts = list(prompts or DEFAULT_PROMPTS)
    return [(GenerationParams(prompt=prompts[i % len(prompts)], seed=i, steps=steps), None) for i in range(images)]


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
    min_ssim: float | None = None,
    min_motion_agreement: float | None = None,
    batch_size: int = 1,
    progress: bool = False,
    device="cpu",
) -> dict[str, Any]:
    """Plain vs each TeaCache threshold on the same requests; see the module docstring.

    A threshold may be ``AUTO_THRESHOLD`` (``"auto"``): the profile's recommendation, shown as
    ``auto (value)`` with the profile's path; when the profile has no recommendation, ``auto`` is
    listed under ``"not_run"`` with the reason and the other thresholds still run. ``batch_size`` requests run per forward (1: each alone, as ``run_request``).
    ``device``: a device name or ``triptych.core.devices.DeviceConfig``.
    """
    from triptych.calibration.batch import Cases, run_cases
    from triptych.calibration.clips import is_video_world
    from triptych.calibration.sweep import fidelity, motion_of, world_adherence
    from triptych.engine.teacache import make_teacache
    from triptych.families.registry import load_family
    from triptych.families.teacache_check import check_teacache

    model_dir = Path(model_dir)
    if images < 1:
        raise InvalidParam("images", images, "must be >= 1")
    if not thresholds or any(not (0 < t <= 2 or t == AUTO_THRESHOLD) for t in thresholds):
        raise InvalidParam("teacache_threshold", thresholds, "give one or more thresholds in (0, 2] or auto")
    family = load_family(model_dir, device=device)
    video = is_video_world(model_dir)
    world = (_is_world_model(model_dir) or video) if world is None else world
    requests = _requests(images, steps, world, prompts, video)
    cases = Cases(family, [p for p, _ in requests])
    scenes = [s for _, s in requests] if world else None
    cache = make_teacache(family, profiles_dir)
    not_run = _unresolvable_auto(cache, thresholds, cases.params[0].steps)
    thresholds = [t for t in thresholds if not (t == AUTO_THRESHOLD and not_run)]
    if not thresholds:
        raise InvalidParam("teacache_threshold", "auto", not_run[0]["reason"] + "; give a number")
    for t in thresholds:  # fail before any compute when a threshold has no profile for these steps
        check_teacache(family, cases.params[0].replace(teacache_threshold=t), profiles_dir)
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(cases) * (1 + len(thresholds)), desc="quality", unit="image", file=sys.stderr)
    tick = bar.update if bar else None
    plain, plain_seconds = run_cases(cases, 0.0, batch_size=batch_size, tag="plain", on_request=tick)
    plain_adherence = world_adherence([o.frames for o in plain], scenes)
    settings = []
    for t in thresholds:
        resolved = cache.resolve(t, cases.params[0].steps)
        value = resolved.threshold
        got, seconds = run_cases(cases, value, cache, batch_size, tag=f"q{value}", on_request=tick)
        fid = fidelity(got, plain)
        skipped, computed = sum(o.skipped for o in got), sum(o.computed for o in got)
        row = SettingReport(
            teacache_threshold=value,
            images=len(got),
            identical=fid["identical"],
            psnr_mean=fid["psnr_mean"],
            psnr_min=fid["psnr_min"],
            ssim_mean=fid["ssim_mean"],
            ssim_min=fid["ssim_min"],
            skipped_fraction=skipped / max(1, skipped + computed),
            adherence=world_adherence([o.frames for o in got], scenes),
            plain_adherence=plain_adherence,
            seconds=seconds,
            auto=t == AUTO_THRESHOLD,
            profile=resolved.profile,
            forward_reduction=(skipped + computed) / max(1, computed),
            denoise_speedup=plain_seconds / seconds if seconds > 0 else math.nan,
            **motion_of(got, plain, scenes),
        )
        if min_psnr is not None and row.psnr_min < min_psnr:
            row.failures.append(f"worst PSNR {row.psnr_min:.2f} dB < {min_psnr} dB")
        if min_ssim is not None and row.ssim_min < min_ssim:
            row.failures.append(f"worst SSIM {row.ssim_min:.4f} < {min_ssim}")
        drop = None if row.adherence is None else plain_adherence - row.adherence
        if max_adherence_drop is not None and drop is not None and drop > max_adherence_drop + 1e-9:
            row.failures.append(
                f"adherence {row.adherence:.0%} is {drop:.0%} below plain {plain_adherence:.0%} "
                f"(allowed: {max_adherence_drop:.0%})"
            )
        if min_motion_agreement is not None and row.motion is not None and row.motion < min_motion_agreement - 1e-9:
            row.failures.append(f"motion kept on {row.motion:.0%} of clips < {min_motion_agreement:.0%}")
        settings.append(row)
    if bar:
        bar.close()
    p0 = cases.params[0]
    return {
        "model": str(model_dir),
        "family": family.name,
        "world": world,
        "images": len(cases),
        "steps": p0.steps,
        "size": f"{p0.width}x{p0.height}",
        "guidance": p0.guidance,
        "seeds": [p.seed for p in cases.params],
        "plain_seconds": plain_seconds,
        "plain_adherence": plain_adherence,
        "gates": {
            "min_psnr": min_psnr,
            "min_ssim": min_ssim,
            "max_adherence_drop": max_adherence_drop,
            "min_motion_agreement": min_motion_agreement,
        },
        "settings": [asdict(s) for s in settings],
        "not_run": not_run,
        "passed": not any(s.failures for s in settings),
    }


def _unresolvable_auto(cache, thresholds: list[float], steps: int) -> list[dict[str, Any]]:
    """``[{"teacache_threshold": "auto", "reason": ...}]`` when ``auto`` is asked for and the profile
    for ``steps`` exists but recommends no threshold (calibration found none meeting its target);
    else ``[]`` (a missing profile is refused by ``check_teacache`` as for any threshold)."""
    if AUTO_THRESHOLD not in thresholds or cache is None:
        return []
    profile = cache.profiles(steps)
    if profile is None or profile.recommended_threshold is not None:
        return []
    return [{"teacache_threshold": "auto", "reason": f"auto: no recommended threshold in profile {profile.path}"}]


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table (what the CLI prints)."""
    head = (
        f"{report['family']} at {report['size']}, {report['steps']} steps, guidance {report['guidance']}, "
        f"{report['images']} requests ({'held-out shape-world prompts' if report['world'] else 'generic prompts'}); "
        f"plain path {report['plain_seconds']:.1f} s"
    )
    clips = any(s.get("motion") is not None for s in report["settings"])
    columns = (
        "TeaCache threshold",
        "skipped",
        "forwards ÷",
        "identical",
        "PSNR mean / worst dB",
        "SSIM mean / worst",
        "adherence plain → cached",
        *(("motion kept", "track drift") if clips else ()),
        "s",
        "gates",
    )
    lines = [head, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for s in report["settings"]:
        name = f"auto ({s['teacache_threshold']:g})" if s.get("auto") else f"{s['teacache_threshold']:g}"
        adh = "n/a" if s["adherence"] is None else f"{s['plain_adherence']:.0%} → {s['adherence']:.0%}"
        gates = "; ".join(s["failures"]) or "pass"
        if clips:
            adh += f" | {s['motion']:.0%} | {s['track_error']:.3f}"
        lines.append(
            f"| {name} | {s['skipped_fraction']:.0%} | {s.get('forward_reduction', 1):.2f} | {s['identical']}/{s['images']} "
            f"| {s['psnr_mean']:.1f} / {s['psnr_min']:.1f} "
            f"| {s['ssim_mean']:.3f} / {s['ssim_min']:.3f} | {adh} | {s['seconds']:.1f} | {gates} |"
        )
    lines += [f"| {n['teacache_threshold']} | not run: {n['reason']} |" for n in report.get("not_run", [])]
    auto = [s for s in report["settings"] if s.get("auto")]
    lines += [f"auto = {s['teacache_threshold']:g} from profile {s['profile']}" for s in auto]
    return "\n".join(lines)


def write(report: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(report) + "\n" if out.suffix == ".md" else json.dumps(report, indent=2, default=str) + "\n"
    out.write_text(text)
    return out
