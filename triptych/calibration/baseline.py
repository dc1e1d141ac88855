"""Stored quality baselines: ``triptych quality --save-baseline DIR`` and ``--baseline DIR``.

A baseline is a directory holding fixed-seed outputs of a request matrix (prompts × sizes × steps ×
guidance × frames): ``outputs.safetensors`` (per case ``<i>.frames``, the decoded float32 frames,
and ``<i>.latents``, the final latents), ``case_<i>.png`` for people, and ``baseline.json`` (format
``triptych.quality.baseline/1``): the package version, the git commit when the code is a checkout,
the model's identity and revision (:mod:`triptych.core.identity`), the configuration it ran (TeaCache
off, dtype, device, each request alone with CFG fused, as the serving engine runs it) and the cases.

Comparing runs the same cases under the configuration being tested (this code, a dtype, a TeaCache
threshold or ``auto``, the serving engine's batching, a parallel degree:
:mod:`triptych.calibration.baseline_run`, which also states each one's gate) and measures per case:
max abs pixel difference, PSNR, SSIM (all frames), latent max abs and relative L2 error, shape-world
adherence (the prompt read back from the pixels: shape, colour, background) for world models, and for
video the frame-to-frame consistency (mean PSNR between consecutive frames) of the current output
beside the baseline's. Gates, on by default:

- an *exact* configuration must match within ``exact_tolerance`` max abs on the frames (default 0:
  identical; CPU float32 is bit-reproducible); *served* and *parallel*
  ones within their stated rounding tolerance;
- an *acceleration* must meet the calibration :class:`~triptych.calibration.sweep.Target` (worst
  PSNR 30 dB, worst SSIM 0.92, adherence drop at most 2 points) and, for video, keep the
  frame-to-frame consistency within ``max_temporal_drop`` dB of the baseline's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from triptych.calibration.baseline_run import Configuration, run_configuration
from triptych.calibration.batch import Cases, Output, run_cases
from triptych.calibration.metrics import psnr, ssim
from triptych.calibration.sweep import WORLD_KEYS
from triptych.calibration.target import Target
from triptych.core.errors import InvalidParam

FORMAT = "triptych.quality.baseline/1"
#: An acceleration may lower a video's frame-to-frame consistency (mean PSNR between consecutive
#: frames) by at most this many dB against the baseline's (SGLang's video gate is PSNR 24 dB against
#: ground truth; this bounds the temporal side, which a per-frame PSNR does not see).
MAX_TEMPORAL_DROP = 3.0
MATRIX_KEYS = ("prompts", "sizes", "steps", "guidance", "frames", "seeds")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triptych")
    except PackageNotFoundError:
        return "unknown"


def git_commit() -> str | None:
    """HEAD of the checkout the package runs from (``+dirty`` with local changes), or None."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def default_matrix(family, world: bool) -> dict[str, list]:
    """A small matrix per family: 2 prompts (held-out shape-world captions for a world model), the
    model's default size, steps and frames, its default guidance and 1 (CFG off / weakest)."""
    from triptych.families.base import GenerationParams

    p0 = family.resolve(GenerationParams(prompt="-"))
    if world:
        from shapeworld import caption, sample_scenes

        prompts = [caption(s) for s in sample_scenes(2, "baseline", "heldout")]
    else:
        from triptych.calibration.collect import DEFAULT_PROMPTS

        prompts = list(DEFAULT_PROMPTS[:2])
    guidance = [p0.guidance] + ([1.0] if p0.guidance is not None and p0.guidance > 1 else [])
    return {
        "prompts": prompts,
        "sizes": [f"{p0.width}x{p0.height}"],
        "steps": [p0.steps],
        "guidance": guidance,
        "frames": [p0.frames],
        "seeds": [0],
    }


def load_matrix(path: str | Path) -> dict[str, list]:
    """A matrix file (YAML or JSON): keys from ``MATRIX_KEYS``, each a list; missing keys take the
    family's defaults. Raises ``InvalidParam("matrix", ...)``."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InvalidParam("matrix", str(path), f"unreadable ({e})") from None
    if not isinstance(data, dict) or set(data) - set(MATRIX_KEYS):
        raise InvalidParam("matrix", str(path), f"must be a mapping with keys from {MATRIX_KEYS}")
    for k, v in data.items():
        if not isinstance(v, list) or not v:
            raise InvalidParam("matrix", str(path), f"{k!r} must be a non-empty list")
    return data


def matrix_cases(matrix: dict[str, list]) -> list[dict[str, Any]]:
    cases = []
    for prompt, size, steps, guidance, frames, seed in itertools.product(*(matrix[k] for k in MATRIX_KEYS)):
        try:
            width, height = (int(v) for v in str(size).lower().split("x"))
        except ValueError:
            raise InvalidParam("matrix", size, "sizes are 'WIDTHxHEIGHT'") from None
        cases.append(
            {"prompt": prompt, "width": width, "height": height, "steps": steps}
            | {"guidance": guidance, "frames": frames, "seed": seed}
        )
    return cases


def _params(case: dict):
    from triptych.families.base import GenerationParams

    return GenerationParams(
        prompt=case["prompt"],
        width=case["width"],
        height=case["height"],
        steps=case["steps"],
        guidance=case["guidance"],
        frames=case["frames"],
        seed=case["seed"],
    )


def adheres(frames: np.ndarray, prompt: str) -> bool | None:
    """Shape-world prompt adherence: shape, colour and background read from the pixels equal the
    prompt's; None when the prompt does not name all three."""
    from shapeworld import parse_caption, read_scene

    want = parse_caption(prompt)
    if any(getattr(want, k) is None for k in WORLD_KEYS):
        return None
    got = read_scene((np.clip(frames[0], 0, 1) * 255).round().astype("uint8"))
    return all(getattr(got, k) == getattr(want, k) for k in WORLD_KEYS)


def save_baseline(
    out_dir: str | Path, model_dir: str | Path, family, matrix: dict | None = None, progress=None
) -> dict:
    """Run the matrix plainly, each case alone, and store it in ``out_dir``; returns the metadata."""
    from safetensors.torch import save_file

    from triptych.calibration.quality import _is_world_model
    from triptych.calibration.report_html import to_uint8
    from triptych.core.identity import model_identity, model_revision

    world = _is_world_model(Path(model_dir))
    matrix = {**default_matrix(family, world), **(matrix or {})}
    cases = matrix_cases(matrix)
    run = Cases(family, [_params(c) for c in cases])
    outputs, _ = run_cases(run, 0.0, batch_size=1, tag="baseline", on_request=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, (case, o) in enumerate(zip(cases, outputs)):
        tensors[f"{i}.frames"] = torch.from_numpy(np.ascontiguousarray(o.frames, dtype=np.float32))
        tensors[f"{i}.latents"] = o.latents.contiguous()
        case["adheres"] = adheres(o.frames, case["prompt"]) if world else None
        case["temporal_psnr"] = temporal_psnr(o.frames)
        from PIL import Image

        Image.fromarray(to_uint8(o.frames)).save(out / f"case_{i}.png")
    save_file(tensors, str(out / "outputs.safetensors"))
    meta = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "triptych_version": package_version(),
        "git_commit": git_commit(),
        "model": {
            "dir": str(model_dir),
            "identity": model_identity(model_dir),
            "revision": model_revision(model_dir),
            "transformer": model_identity(model_dir, ("transformer",)),
        },
        "family": family.name,
        "world": world,
        "configuration": Configuration().describe(family),
        "matrix": matrix,
        "cases": cases,
    }
    (out / "baseline.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def temporal_psnr(frames: np.ndarray) -> float | None:
    """Frame-to-frame consistency of a video: mean PSNR (dB) between consecutive frames (a static
    video is inf); None for a single image. A cache that makes frames drift apart lowers it."""
    if frames.shape[0] < 2:
        return None
    return float(np.mean([min(psnr(a, b), 100.0) for a, b in zip(frames[1:], frames[:-1])]))


def load_baseline(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    d = Path(directory)
    try:
        meta = json.loads((d / "baseline.json").read_text())
        tensors = load_file(str(d / "outputs.safetensors"))
    except (OSError, ValueError) as e:
        raise InvalidParam("baseline", str(d), f"is not a readable baseline directory ({e})") from None
    if meta.get("format") != FORMAT:
        raise InvalidParam("baseline", str(d), f"baseline.json 'format' must be {FORMAT!r}")
    return meta, tensors


def compare_baseline(
    directory: str | Path,
    model_dir: str | Path,
    family,
    threshold: float = 0.0,
    target: Target | None = None,
    exact_tolerance: float | None = None,
    progress=None,
    served: int = 0,
    parallel=None,
    gate: str = "auto",
    max_temporal_drop: float = MAX_TEMPORAL_DROP,
) -> tuple[dict, list[Output], dict]:
    """Run the baseline's cases under the configuration (``threshold``: 0, a number or
    ``AUTO_THRESHOLD``; ``served``: engine batch size or 0; ``parallel``: a ``ParallelConfig`` or
    None; ``gate``: auto/exact/target, see :mod:`~triptych.calibration.baseline_run`) and gate them;
    ``exact_tolerance`` None takes the configuration's default. Returns (report, current outputs,
    baseline tensors)."""
    from triptych.accel.teacache_profile import AUTO_THRESHOLD
    from triptych.core.identity import model_identity, model_revision
    from triptych.engine.teacache import make_teacache
    from triptych.families.teacache_check import check_teacache

    meta, tensors = load_baseline(directory)
    target = target or Target()
    cases = meta["cases"]
    run = Cases(family, [_params(c) for c in cases])
    value, cache = 0.0, None
    if threshold:
        check_teacache(family, run.params[0].replace(teacache_threshold=threshold))
        cache = make_teacache(family)
        value = cache.resolve(threshold, run.params[0].steps).threshold
    requested = "auto" if threshold == AUTO_THRESHOLD else (threshold or None)
    config = Configuration(value, requested, served, parallel, gate)
    outputs, seconds = run_configuration(run, config, cache, progress)
    rows = [_case_row(i, c, o, tensors, meta["world"]) for i, (c, o) in enumerate(zip(cases, outputs))]
    kind = config.kind()
    exact = kind != "acceleration"
    tolerance = config.default_tolerance() if exact_tolerance is None else exact_tolerance
    report = {
        "baseline": {k: meta[k] for k in ("created", "triptych_version", "git_commit", "model", "configuration")},
        "current": {
            "triptych_version": package_version(),
            "git_commit": git_commit(),
            "model": {"identity": model_identity(model_dir), "revision": model_revision(model_dir)},
            "configuration": config.describe(family),
        },
        "kind": kind,
        "gates": {"exact_tolerance": tolerance}
        if exact
        else {**dataclasses.asdict(target), "max_temporal_drop": max_temporal_drop},
        "denoise_seconds": seconds,
        "cases": rows,
        "summary": _summary(rows),
    }
    report["failures"] = _gate(report, target, tolerance, max_temporal_drop)
    report["passed"] = not report["failures"]
    return report, outputs, tensors


def _case_row(i: int, case: dict, out: Output, tensors: dict, world: bool) -> dict:
    want = tensors[f"{i}.frames"].numpy()
    want_lat = tensors[f"{i}.latents"].float()
    got_lat = out.latents.float()
    if want.shape != out.frames.shape or want_lat.shape != got_lat.shape:
        raise InvalidParam("baseline", f"case {i}", f"shape changed: {want.shape} vs {out.frames.shape}")
    lat_err = float((got_lat - want_lat).norm() / want_lat.norm().clamp_min(1e-12))
    return {
        "index": i,
        "prompt": case["prompt"],
        "size": f"{case['width']}x{case['height']}",
        "steps": case["steps"],
        "guidance": case["guidance"],
        "seed": case["seed"],
        "max_abs": float(np.abs(out.frames.astype(np.float64) - want).max()),
        "psnr": psnr(out.frames, want),
        "ssim": ssim(out.frames, want),
        "latent_max_abs": float((got_lat - want_lat).abs().max()),
        "latent_rel_l2": lat_err,
        "skipped_fraction": out.skipped / max(1, out.skipped + out.computed),
        "baseline_adheres": case.get("adheres"),
        "adheres": adheres(out.frames, case["prompt"]) if world else None,
        "frames": int(out.frames.shape[0]),
        "baseline_temporal_psnr": temporal_psnr(want),
        "temporal_psnr": temporal_psnr(out.frames),
    }


def _summary(rows: list[dict]) -> dict:
    scored = [r for r in rows if r["adheres"] is not None and r["baseline_adheres"] is not None]
    drops = [r["baseline_temporal_psnr"] - r["temporal_psnr"] for r in rows if r["temporal_psnr"] is not None]
    return {
        "cases": len(rows),
        "identical": sum(r["max_abs"] == 0 for r in rows),
        "max_abs": max(r["max_abs"] for r in rows),
        "psnr_min": min(r["psnr"] for r in rows),
        "ssim_min": min(r["ssim"] for r in rows),
        "latent_rel_l2_max": max(r["latent_rel_l2"] for r in rows),
        "skipped_fraction": float(np.mean([r["skipped_fraction"] for r in rows])),
        "baseline_adherence": sum(r["baseline_adheres"] for r in scored) / len(scored) if scored else None,
        "adherence": sum(r["adheres"] for r in scored) / len(scored) if scored else None,
        "temporal_drop_max": max(drops) if drops else None,  # dB, baseline's consistency - current's
    }


def _gate(report: dict, target: Target, exact_tolerance: float, max_temporal_drop: float) -> list[str]:
    s = report["summary"]
    if report["kind"] != "acceleration":
        bad = [r for r in report["cases"] if r["max_abs"] > exact_tolerance]
        return [f"case {r['index']}: max abs {r['max_abs']:.3g} > tolerance {exact_tolerance:g}" for r in bad]
    row = {"psnr_min": s["psnr_min"], "ssim_min": s["ssim_min"], "adherence": s["adherence"]}
    row["plain_adherence"] = s["baseline_adherence"]
    out = target.failures(row)
    for r in report["cases"]:
        if r["temporal_psnr"] is not None and r["baseline_temporal_psnr"] - r["temporal_psnr"] > max_temporal_drop:
            out.append(
                f"case {r['index']}: frame-to-frame PSNR {r['temporal_psnr']:.2f} dB is more than "
                f"{max_temporal_drop:g} dB below the baseline's {r['baseline_temporal_psnr']:.2f} dB"
            )
    return out
