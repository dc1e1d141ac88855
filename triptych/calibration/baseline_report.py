"""Reports of a baseline comparison: ``report.json`` (everything), ``report.md`` (the summary and the
case table) and ``index.html`` (summary, a PSNR-per-case plot, and per case a grid
baseline | current | difference heatmap), all in one directory with the images beside the HTML."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from triptych.calibration.report_html import Page, fmt, heatmap, pyplot, to_uint8

CASE_COLUMNS = ("case", "prompt", "size", "steps", "guidance", "seed", "max abs", "PSNR dB", "SSIM")
CASE_COLUMNS += ("latent rel L2", "skipped", "adheres (baseline → current)", "frame→frame dB (baseline → current)")


def _cells(r: dict) -> tuple:
    adh = "n/a" if r["adheres"] is None else f"{r['baseline_adheres']} → {r['adheres']}"
    tmp = r.get("temporal_psnr")
    tmp = "n/a" if tmp is None else f"{fmt(r['baseline_temporal_psnr'], '.1f')} → {fmt(tmp, '.1f')}"
    return (
        r["index"],
        r["prompt"],
        r["size"],
        r["steps"],
        fmt(r["guidance"], "g"),
        r["seed"],
        fmt(r["max_abs"], ".3g"),
        fmt(r["psnr"], ".1f"),
        fmt(r["ssim"], ".4f"),
        fmt(r["latent_rel_l2"], ".3g"),
        fmt(r["skipped_fraction"], ".0%"),
        adh,
        tmp,
    )


def _headline(report: dict) -> list[str]:
    b, c, s = report["baseline"], report["current"], report["summary"]
    verdict = "PASSED" if report["passed"] else "FAILED"
    conf = c["configuration"]
    gate = "target" if report["kind"] == "acceleration" else f"{report['kind']} (max abs)"
    what = f"{_what(conf, b['configuration'])}, gate {gate}"
    lines = [
        f"Gates {verdict}: {what} against the baseline of {b['created']} "
        f"(triptych {b['triptych_version']}, commit {b['git_commit'] or 'n/a'}); current: triptych "
        f"{c['triptych_version']}, commit {c['git_commit'] or 'n/a'}.",
        f"Model: baseline {b['model']['identity']}, current {c['model']['identity']}"
        + ("" if b["model"]["revision"] == c["model"]["revision"] else " (DIFFERENT revision)")
        + f"; dtype {conf['dtype']} on {conf['device']}.",
        f"Gates: {report['gates']}.",
        f"{s['cases']} cases, {s['identical']} identical; worst max abs {s['max_abs']:.3g}, worst PSNR "
        f"{fmt(s['psnr_min'], '.1f')} dB, worst SSIM {s['ssim_min']:.4f}, worst latent rel L2 "
        f"{s['latent_rel_l2_max']:.3g}, skipped {s['skipped_fraction']:.0%}, adherence "
        f"{fmt(s['baseline_adherence'], '.0%')} → {fmt(s['adherence'], '.0%')}"
        + (
            ""
            if s.get("temporal_drop_max") is None
            else f", frame-to-frame consistency worst drop {s['temporal_drop_max']:.2f} dB"
        )
        + ".",
    ]
    lines += [f"FAIL: {f}" for f in report["failures"]]
    return lines


def _what(conf: dict, base: dict) -> str:
    parts = []
    if conf["teacache_threshold"]:
        auto = " (auto)" if conf["teacache_requested"] == "auto" else ""
        parts.append(f"TeaCache threshold {conf['teacache_threshold']:g}{auto}")
    if conf.get("served"):
        parts.append(f"served, engine batch {conf['batch']}")
    if conf.get("parallel"):
        parts.append("parallel " + ", ".join(f"{k} {v}" for k, v in conf["parallel"].items() if v not in (1, True)))
    if conf["dtype"] != base["dtype"]:
        parts.append(f"dtype {conf['dtype']} (baseline {base['dtype']})")
    if conf.get("compile"):
        parts.append("--compile")
    parts += [f"--quantize {q}" for q in conf.get("quantize", ())]
    return "; ".join(parts) or "this code, as the baseline ran"


def markdown(report: dict) -> str:
    lines = _headline(report) + ["", "| " + " | ".join(CASE_COLUMNS) + " |", "|" + "---|" * len(CASE_COLUMNS)]
    lines += ["| " + " | ".join(str(c) for c in _cells(r)) + " |" for r in report["cases"]]
    return "\n".join(lines)


def write_reports(out_dir: str | Path, report: dict, outputs, tensors) -> Path:
    """Write the three reports into ``out_dir``; returns the HTML path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(report) + "\n")
    page = Page(out, "Quality against a stored baseline")
    for line in _headline(report):
        page.text(line)
    page.figure("psnr_per_case", _psnr_figure(report))
    page.table(CASE_COLUMNS, [_cells(r) for r in report["cases"]], _classes(report))
    page.heading("Cases: baseline | current | |difference| (heatmap, scale 0 → largest difference)")
    vmax = max(report["summary"]["max_abs"], 1 / 255)
    rows, videos = [], []
    for r, o in zip(report["cases"], outputs):
        want = tensors[f"{r['index']}.frames"].numpy()
        if want.shape[0] > 1:  # video: every frame, side by side (rows: baseline, current)
            strip = np.concatenate([np.concatenate(list(f), axis=1) for f in (want, o.frames)], axis=0)
            videos.append(
                [
                    f"{r['index']}: frames 0..{want.shape[0] - 1}",
                    page.image(f"frames_{r['index']}", _u8(strip)).replace("<img ", '<img class="strip" '),
                ]
            )
        rows.append(
            [
                f"{r['index']}: {r['prompt']}<br>PSNR {fmt(r['psnr'], '.1f')} dB, max abs {r['max_abs']:.3g}",
                page.image(f"baseline_{r['index']}", to_uint8(want)),
                page.image(f"current_{r['index']}", to_uint8(o.frames)),
                page.image(f"diff_{r['index']}", heatmap(o.frames, want, vmax)),
            ]
        )
    page.grid(("case", "baseline", "current", f"|difference| (0 → {vmax:.3g})"), rows)
    if videos:
        page.heading("Video cases: all frames (top: baseline, bottom: current)")
        page.grid(("case", "frames"), videos)
    return page.write()


def _u8(frames) -> np.ndarray:
    return (np.clip(frames, 0, 1) * 255).round().astype("uint8")


def _classes(report: dict) -> list[str]:
    if report["kind"] != "acceleration":
        tol = report["gates"]["exact_tolerance"]
        return ["fail" if r["max_abs"] > tol else "pass" for r in report["cases"]]
    g = report["gates"]
    return ["fail" if r["psnr"] < g["min_psnr"] or r["ssim"] < g["min_ssim"] else "pass" for r in report["cases"]]


def _psnr_figure(report: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    rows = report["cases"]
    values = [min(r["psnr"], 100) for r in rows]
    ax.bar([str(r["index"]) for r in rows], values, color=["tab:green" if v >= 100 else "tab:blue" for v in values])
    if report["kind"] == "acceleration":
        ax.axhline(report["gates"]["min_psnr"], color="r", lw=1, label="gate")
        ax.legend()
    ax.set_xlabel("case")
    ax.set_ylabel("PSNR vs baseline, dB (identical drawn at 100)")
    return fig
