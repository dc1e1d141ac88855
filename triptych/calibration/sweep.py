"""The threshold sweep of ``triptych calibrate`` and the recommendation it writes into the profile.

For each TeaCache setting (threshold × warmup × cap on consecutive skips × residual forecast) the sweep runs the same
held-out requests (prompts and seeds the fit never saw) as the plain path, in the same batch
composition, and measures: forwards skipped, the denoise speedup (CPU time of the denoise loop,
plain / cached, in this run), PSNR and SSIM against the plain images (mean and worst; a clip counts
by its worst frame), and shape-world adherence for models that draw that world; for the moving shape
world also the motion agreement with the plain clips (``triptych.calibration.clips``). The recommendation is the setting with the largest saving whose
worst case meets the :class:`Target`; none meeting it gives no recommendation (``"auto"`` is then
refused with a 400 naming the field).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from triptych.accel.teacache import TeaCache
from triptych.accel.teacache_profile import TeaCacheProfile
from triptych.calibration.batch import Cases, Output, run_cases
from triptych.calibration.metrics import psnr, ssim
from triptych.calibration.target import Target

WORLD_KEYS = ("shape", "color", "background")


def world_adherence(arrays: Sequence[np.ndarray], scenes) -> float | None:
    """Share of images whose shape, colour and background read back as asked (clips: and the
    direction, ``clips.clip_adherence``); None off-world."""
    if not scenes:
        return None
    from shapeworld import score
    from shapeworld.video import Clip

    if isinstance(scenes[0], Clip):
        from triptych.calibration.clips import clip_adherence

        return clip_adherence(arrays, scenes)

    ok = [all(score((a[0] * 255).round().astype("uint8"), s)[k] for k in WORLD_KEYS) for a, s in zip(arrays, scenes)]
    return sum(ok) / len(ok)


def worst_frame(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """PSNR and SSIM of the worst frame of ``got`` against ``want`` ((frames, H, W, 3); an image is
    one frame)."""
    pairs = [(got[i : i + 1], want[i : i + 1]) for i in range(len(want))]
    return min(psnr(a, b) for a, b in pairs), min(ssim(a, b) for a, b in pairs)


def fidelity(got: Sequence[Output], want: Sequence[Output]) -> dict:
    """PSNR / SSIM of each output against its plain one, each clip by its worst frame: mean (finite
    values) and worst, plus identical."""
    worst = [worst_frame(g.frames, w.frames) for g, w in zip(got, want)]
    psnrs, ssims = [p for p, _ in worst], [s for _, s in worst]
    finite = [p for p in psnrs if math.isfinite(p)]
    return {
        "identical": len(psnrs) - len(finite),
        "psnr_mean": float(np.mean(finite)) if finite else math.inf,
        "psnr_min": min(psnrs),
        "ssim_mean": float(np.mean(ssims)),
        "ssim_min": min(ssims),
        "psnr_each": psnrs,
    }


@dataclass
class SweepResult:
    """The table (one dict per setting, plain first), the plain outputs and each setting's outputs."""

    rows: list[dict]
    plain: list[Output]
    outputs: dict[tuple, list[Output]] = field(default_factory=dict)  # (threshold, *Variant) -> outputs


#: One swept TeaCache variant: (warmup, max_skips or None, forecast order).
Variant = tuple[int, int | None, int]


def sweep(
    cache_for: Callable[[TeaCacheProfile], TeaCache],
    profile: TeaCacheProfile,
    cases: Cases,
    thresholds: Sequence[float],
    variants: Sequence[Variant] = ((1, None, 0),),
    scenes=None,
    target: Target | None = None,
    batch_size: int = 8,
    progress: Callable[[], None] | None = None,
) -> SweepResult:
    """Plain, then every (threshold, (warmup, max_skips, forecast)) on ``cases``; rows carry their gate
    failures."""
    target = target or Target()
    run_cases(Cases(cases.family, cases.params[:1]), 0.0, tag="warm")  # first calls are slow; not timed
    plain, plain_s = run_cases(cases, 0.0, batch_size=batch_size, tag="plain", on_request=progress)
    plain_adh = world_adherence([o.frames for o in plain], scenes)
    total = sum(o.computed for o in plain)
    rows = [_row(0.0, (profile.warmup, None, 0), plain, plain, plain_s, plain_s, total, plain_adh, plain_adh)]
    rows[0].update(motion_of(plain, plain, scenes))
    result = SweepResult(rows, plain)
    for warmup, max_skips, forecast in variants:
        variant = dataclasses.replace(profile, warmup=warmup, max_skips=max_skips, forecast=forecast)
        cache = cache_for(variant)
        for t in thresholds:
            got, secs = run_cases(cases, t, cache, batch_size, tag=f"t{t}", on_request=progress)
            adh = world_adherence([o.frames for o in got], scenes)
            row = _row(t, (warmup, max_skips, forecast), got, plain, secs, plain_s, total, adh, plain_adh)
            row.update(motion_of(got, plain, scenes))
            row["failures"] = target.failures(row)
            rows.append(row)
            result.outputs[(t, warmup, max_skips, forecast)] = got
    return result


def motion_of(got: Sequence[Output], plain: Sequence[Output], scenes) -> dict:
    """``{"motion": share keeping the plain clips' direction and colour, "track_error": largest
    centroid drift}`` for clips of the moving shape world; ``{}`` for anything else."""
    from shapeworld.video import Clip

    if not scenes or not isinstance(scenes[0], Clip):
        return {}
    from triptych.calibration.clips import motion_agreement

    share, drift = motion_agreement([o.frames for o in got], [o.frames for o in plain])
    return {"motion": share, "track_error": drift}


def _row(t, variant: Variant, got, plain, secs, plain_s, total, adh, plain_adh) -> dict:
    computed = sum(o.computed for o in got)
    fid = fidelity(got, plain)
    return {
        "threshold": t,
        "warmup": variant[0],
        "max_skips": variant[1],
        "forecast": variant[2],
        "images": len(got),
        "skipped_fraction": 1 - computed / total,
        "forward_reduction": total / computed,  # transformer forwards (rows) plain / cached
        "denoise_speedup": plain_s / secs if secs > 0 else math.nan,  # CPU time, measured in this run
        "seconds": secs,
        **{k: v for k, v in fid.items() if k != "psnr_each"},
        "psnr_each": fid["psnr_each"],
        "adherence": adh,
        "plain_adherence": plain_adh,
        "failures": [],
    }


def recommend(rows: Sequence[dict]) -> dict | None:
    """The setting with the largest saving among those that met the target (ties: the smaller
    threshold, then the one with more margin: the higher worst-case PSNR); None when none did or
    none saved anything."""
    ok = [r for r in rows if r["threshold"] > 0 and r["skipped_fraction"] > 0 and not r["failures"]]
    if not ok:
        return None
    return max(ok, key=lambda r: (round(r["skipped_fraction"], 9), -r["threshold"], r["psnr_min"]))


def table_markdown(rows: Sequence[dict], chosen: dict | None = None) -> str:
    """The sweep as a markdown table (the CLI prints it; the profile stores the rows)."""
    cols = ("threshold", "warmup", "max skips", "forecast", "skipped", "forwards ÷", "denoise ×", "PSNR mean/worst dB")
    clips = any("motion" in r for r in rows)
    cols += ("SSIM mean/worst", "adherence") + (("motion kept", "track drift") if clips else ()) + ("target",)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        adh = "n/a" if r["adherence"] is None else f"{r['adherence']:.0%}"
        if clips:
            adh += f" | {r['motion']:.0%} | {r['track_error']:.3f}"
        mark = "plain" if r["threshold"] == 0 else ("; ".join(r["failures"]) or "meets")
        if chosen is not None and r is chosen:
            mark = "**recommended**"
        lines.append(
            f"| {r['threshold']:g} | {r['warmup']} | {r['max_skips'] or '-'} | {r['forecast']} "
            f"| {r['skipped_fraction']:.0%} "
            f"| {r['forward_reduction']:.2f} | {r['denoise_speedup']:.2f} | {r['psnr_mean']:.1f} / {r['psnr_min']:.1f} "
            f"| {r['ssim_mean']:.3f} / {r['ssim_min']:.3f} | {adh} | {mark} |"
        )
    return "\n".join(lines)
