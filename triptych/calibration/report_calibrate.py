"""The HTML report of ``triptych calibrate --report DIR``: the fit plot (per CFG branch, with the
joint polynomial), the speed/quality curve of the sweep with the target, the sweep table, and
side-by-side images of the first evaluation requests at every threshold."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from triptych.accel.teacache_profile import TeaCacheProfile
from triptych.calibration.collect import Trajectory
from triptych.calibration.report_html import Page, fmt, pyplot, to_uint8

SHOWN_IMAGES = 4


def write_calibration_report(out_dir: str | Path, profile: TeaCacheProfile, trajectories: Sequence[Trajectory], result):
    """Write ``out_dir/index.html``; ``result``: the ``SweepResult`` (None: fit only)."""
    page = Page(out_dir, f"TeaCache calibration: {profile.family}, {profile.steps} steps ({profile.model})")
    q = profile.quality
    page.heading("Fit")
    page.text(
        f"output rel-L1 ≈ polyval(coefficients, input rel-L1), degree 4, over {q['points']} points "
        f"({q['trajectories']} trajectories: {len(q['prompts'])} prompts × seeds {q['seeds']}): "
        f"r² {q['r2']:.3f}, rmse {q['rmse']:.4f}."
    )
    page.figure("fit", _fit_figure(profile, trajectories))
    per = q.get("per_branch", {})
    page.table(
        ("branch", "points", "r² of the joint fit", "r² of its own fit", "rmse joint", "rmse own"),
        [
            (b, f["points"], fmt(f["joint_r2"], ".3f"), fmt(f["own_r2"], ".3f"), fmt(f["joint_rmse"], ".4f"))
            + (fmt(f["own_rmse"], ".4f"),)
            for b, f in per.items()
        ],
    )
    if result is None:
        page.write()
        return
    rows = result.rows
    page.heading("Threshold sweep")
    chosen = profile.recommended_threshold
    page.text(
        f"{rows[0]['images']} evaluation requests (prompts and seeds the fit never saw); target: "
        f"{profile.target}. Recommended threshold: {chosen if chosen is not None else 'none met the target'}"
        + (
            f" (warmup {profile.warmup}, max consecutive skips {profile.max_skips}, forecast {profile.forecast})."
            if chosen is not None
            else "."
        )
    )
    page.figure("speed_quality", _curve_figure(rows, profile.target))
    header = ("threshold", "warmup", "max skips", "forecast", "skipped", "forwards ÷", "denoise ×", "PSNR mean")
    header += ("PSNR worst",)
    header += ("SSIM mean", "SSIM worst", "adherence", "target")
    table, classes = [], []
    for r in rows:
        table.append(
            (
                fmt(r["threshold"], "g"),
                r["warmup"],
                r["max_skips"] or "-",
                r["forecast"],
                fmt(r["skipped_fraction"], ".0%"),
                fmt(r["forward_reduction"]),
                fmt(r["denoise_speedup"]),
                fmt(r["psnr_mean"], ".1f"),
                fmt(r["psnr_min"], ".1f"),
                fmt(r["ssim_mean"], ".3f"),
                fmt(r["ssim_min"], ".3f"),
                fmt(r["adherence"], ".0%"),
                "plain" if r["threshold"] == 0 else ("; ".join(r["failures"]) or "meets"),
            )
        )
        classes.append("" if r["threshold"] == 0 else ("fail" if r["failures"] else "pass"))
    page.table(header, table, classes)
    _side_by_side(page, result, profile, profile.sweep.get("prompts", []))
    page.write()


def _fit_figure(profile: TeaCacheProfile, trajectories: Sequence[Trajectory]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for branch, colour in zip(sorted({t.branch for t in trajectories}), ("tab:blue", "tab:orange", "tab:green")):
        x = [v for t in trajectories if t.branch == branch for v in t.input_rel]
        y = [v for t in trajectories if t.branch == branch for v in t.output_rel]
        ax.scatter(x, y, s=9, alpha=0.5, color=colour, label=f"{branch} ({len(x)} points)")
    xs = np.linspace(*profile.quality["x_range"], 200)
    ax.plot(xs, np.polyval(profile.coefficients, xs), color="k", label=f"joint fit, r²={profile.quality['r2']:.3f}")
    ax.set_xlabel("modulated input rel-L1 change")
    ax.set_ylabel("model output rel-L1 change")
    ax.legend()
    return fig


def _curve_figure(rows, target: dict):
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key in sorted({(r["warmup"], r["max_skips"], r["forecast"]) for r in rows if r["threshold"] > 0}, key=str):
        rs = [r for r in rows if r["threshold"] > 0 and (r["warmup"], r["max_skips"], r["forecast"]) == key]
        x = [r["forward_reduction"] for r in rs]
        label = f"warmup {key[0]}, cap {key[1] or '-'}, forecast {key[2]}"
        a1.plot(x, [min(r["psnr_min"], 80) for r in rs], "o-", label=f"{label}: worst")
        a1.plot(x, [min(r["psnr_mean"], 80) for r in rs], "x--", alpha=0.6, label=f"{label}: mean")
        a2.plot(x, [r["ssim_min"] for r in rs], "o-", label=label)
        for r in rs:
            a1.annotate(f"{r['threshold']:g}", (r["forward_reduction"], min(r["psnr_min"], 80)), fontsize=7)
    if "min_psnr" in target:
        a1.axhline(target["min_psnr"], color="r", lw=1, label="target")
    if "min_ssim" in target:
        a2.axhline(target["min_ssim"], color="r", lw=1, label="target")
    a1.set_xlabel("transformer forwards, plain ÷ cached")
    a1.set_ylabel("PSNR vs plain, dB (capped at 80)")
    a2.set_xlabel("transformer forwards, plain ÷ cached")
    a2.set_ylabel("worst SSIM vs plain")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    return fig


def _side_by_side(page: Page, result, profile: TeaCacheProfile, prompts: Sequence[str]) -> None:
    """Plain and every threshold of the first variant swept and of the recommended one."""
    keys = list(result.outputs)
    recommended = (profile.warmup, profile.max_skips, profile.forecast)
    shown = {keys[0][1:]} | ({recommended} if profile.recommended_threshold else set())
    keys = sorted((k for k in keys if k[1:] in shown), key=lambda k: (str(k[1:]), k[0]))
    n = min(SHOWN_IMAGES, len(result.plain))
    page.heading("Side by side (first variant swept and the recommended one)")
    header = ["request", "plain"] + [f"t={t:g} w={w} cap={c or '-'} f={f}" for t, w, c, f in keys]
    rows = []
    for i in range(n):
        cells = [prompts[i] if i < len(prompts) else str(i), page.image(f"plain_{i}", to_uint8(result.plain[i].frames))]
        for k in keys:
            tag = f"t{k[0]:g}_w{k[1]}_c{k[2] or 0}_f{k[3]}_{i}"
            cells.append(page.image(tag, to_uint8(result.outputs[k][i].frames)))
        rows.append(cells)
    page.grid(header, rows)
