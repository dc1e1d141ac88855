"""The command line of ``triptych calibrate`` and ``triptych quality``: their flags, what they run and
what they print (``triptych.cli`` adds them; split from it to keep each file under 400 lines). The
library they call (``triptych.calibration``) prints nothing. Defaults of the gates are the
calibration target (:class:`Target`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

from triptych.accel.teacache_profile import AUTO_THRESHOLD, FORECAST_ORDERS
from triptych.calibration.target import Target
from triptych.cli.worker_flags import add_degree_flags
from triptych.core.devices import add_device_flags, add_threads_flag, device_config_from_args, set_torch_threads
from triptych.core.errors import InvalidParam

DEFAULT_TARGET = Target()


def threshold_arg(text: str) -> float:
    """A ``--teacache-threshold`` value: a number, or ``auto`` (the profile's recommendation)."""
    if text.strip().lower() == "auto":
        return AUTO_THRESHOLD
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'auto'") from None


def _add_target(p, gates: str) -> None:
    t = DEFAULT_TARGET  # None: --baseline with TeaCache takes the profile's calibrated target, else these
    p.add_argument("--min-psnr", type=float, help=f"{gates}: worst PSNR, dB (default {t.min_psnr:g})")
    p.add_argument("--min-ssim", type=float, help=f"{gates}: worst SSIM (default {t.min_ssim:g})")
    p.add_argument(
        "--max-adherence-drop",
        type=float,
        help=f"{gates}: largest drop of world adherence, a fraction (default {t.max_adherence_drop:g} = 2 points)",
    )
    p.add_argument(
        "--min-motion-agreement",
        type=float,
        help=f"{gates}, moving shape world: least share of clips keeping the plain clip's direction and "
        f"colour (default {t.min_motion_agreement:g})",
    )


def add_calibrate(sub) -> None:
    from triptych.calibration.target import DEFAULT_THRESHOLDS, FIT_SEEDS

    p = sub.add_parser("calibrate", help="fit a TeaCache profile, sweep thresholds and recommend one")
    p.add_argument("--model", help="diffusers model directory (default: the built-in model)")
    p.add_argument("--steps", type=int, required=True, help="the step schedule the profile is for")
    p.add_argument(
        "--prompt",
        action="append",
        help="fit prompt (repeatable; default: train-split captions for a shape-world model, else a built-in set)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=list(FIT_SEEDS), help="fit seeds")
    p.add_argument("--fit-prompts", type=int, default=4, help="shape-world models: number of fit captions")
    p.add_argument(
        "--out",
        help="profile path (default: $XDG_DATA_HOME/triptych/teacache/<model identity>/<family>-<steps>steps.json, "
        "~/.local/share without XDG_DATA_HOME; never inside the installed package)",
    )
    p.add_argument("--image", help="condition image (edit / image-to-video families)")
    p.add_argument(
        "--thresholds", type=float, nargs="*", default=list(DEFAULT_THRESHOLDS), help="swept (none: fit only)"
    )
    p.add_argument("--eval-images", type=int, default=16, help="evaluation requests (unseen prompts and seeds)")
    # NOTE: defaults from the default model's sweep (RESULTS in the commit adding them): computing the
    # first 4 of 20 steps and capping skips at 1 in a row raised the saving that meets the target
    # from 11% to 36% of forwards; plain TeaCache (1, none) stays in the grid as the reference.
    p.add_argument("--warmup", type=int, nargs="+", default=[1, 4], help="first steps always computed (swept)")
    p.add_argument(
        "--max-skips", type=int, nargs="+", default=[0, 1, 2], help="cap on consecutive skips, 0 = none (swept)"
    )
    p.add_argument(
        "--forecast",
        type=int,
        nargs="+",
        default=[0],
        help="residual of a skipped step (swept): 0 = reuse the last computed one, 1 = linear forecast "
        "from the last two (TaylorSeer order 1)",
    )
    p.add_argument("--batch", type=int, default=8, help="requests per forward in the sweep")
    p.add_argument("--report", metavar="DIR", help="write an HTML report (fit plot, curves, images) into DIR")
    _add_target(p, "recommendation target")
    add_device_flags(p)
    add_threads_flag(p)
    p.set_defaults(func=cmd_calibrate, check=check_calibrate)


def check_calibrate(args) -> None:
    """Before torch: numbers, the image, ``--out`` outside the package, the target."""
    from triptych.cli.checks import check_common, read_image
    from triptych.cli.profiles import check_out

    check_common(args)
    if args.steps < 1:
        raise InvalidParam("steps", args.steps, "must be >= 1")
    if args.eval_images < 1:
        raise InvalidParam("eval_images", args.eval_images, "must be >= 1")
    if min(args.warmup) < 0 or min(args.max_skips) < 0:
        raise InvalidParam("warmup/max_skips", (args.warmup, args.max_skips), "must be >= 0")
    if not set(args.forecast) <= set(FORECAST_ORDERS):
        raise InvalidParam("forecast", args.forecast, f"each must be one of {FORECAST_ORDERS}")
    check_out(args.out)
    _target(args)
    args.image_rgb = read_image(args.image) if args.image else None


def _warn_small_eval_set(model, args, target: Target) -> None:
    """The adherence drop is judged as a share of the evaluation images (shape-world models): with
    fewer than ``target.images_needed()`` one image moves it past the allowed drop."""
    from triptych.calibration.clips import is_video_world
    from triptych.calibration.quality import _is_world_model

    needed = target.images_needed()
    world = _is_world_model(model) or is_video_world(model)
    if args.thresholds and needed and args.eval_images < needed and world:
        print(
            f"warning: --eval-images {args.eval_images} is too few for the target: adherence is judged as a "
            f"share of the images, so one image moves it {100 / args.eval_images:.1f} points (allowed: "
            f"{target.max_adherence_drop * 100:g}); the target needs at least {needed} images",
            file=sys.stderr,
        )


def cmd_calibrate(args) -> int:
    from triptych.calibration.fit import DEFAULT_PROMPTS, calibrate
    from triptych.calibration.quality import world_prompts
    from triptych.calibration.sweep import table_markdown
    from triptych.cli.profiles import user_profiles_dir
    from triptych.families.models import resolve_model

    device = device_config_from_args(args)
    set_torch_threads(args.threads)
    base = {"image": args.image_rgb} if args.image_rgb is not None else {}
    model = resolve_model(args.model, os.environ.get("TRIPTYCH_CACHE"))
    prompts = args.prompt or world_prompts(model, args.fit_prompts) or DEFAULT_PROMPTS
    variants = [(w, c or None, f) for w, c, f in itertools.product(args.warmup, args.max_skips, args.forecast)]
    target = _target(args)
    _warn_small_eval_set(model, args, target)
    profile, path = calibrate(
        model,
        args.steps,
        prompts,
        args.seeds,
        args.out,
        thresholds=args.thresholds,
        variants=variants,
        eval_images=args.eval_images,
        target=target,
        batch_size=args.batch,
        report_dir=args.report,
        progress=True,
        device=device,
        profiles_dir=user_profiles_dir(model),
        **base,
    )
    q = profile.quality
    print(f"fit: r2={q['r2']:.4f} rmse={q['rmse']:.3g} points={q['points']} x_range={q['x_range']}")
    for branch, f in q.get("per_branch", {}).items():
        print(f"  {branch}: r2 of the joint fit {f['joint_r2']:.4f}, of its own fit {f['own_r2']:.4f}")
    rows = profile.sweep.get("rows")
    if rows:
        chosen = profile.sweep.get("recommended_row")
        print(table_markdown(rows, rows[chosen] if chosen is not None else None))
        rec = profile.recommended_threshold
        print(
            f"recommended threshold: {rec:g} (warmup {profile.warmup}, max skips {profile.max_skips}, "
            f"forecast {profile.forecast})"
            if rec is not None
            else f"no threshold meets the target {target}; the profile has no recommendation"
        )
    print(f"wrote {path}" + (f"; report {args.report}/index.html" if args.report else ""))
    return 0


def _profile_target(model, args) -> dict:
    """The calibrated target of the model's profile for the baseline's steps (a TeaCache comparison
    is held to what calibration promised), or {} (then ``Target``'s defaults)."""
    if not args.baseline or not args.teacache_threshold or not args.teacache_threshold[0]:
        return {}
    import json
    from pathlib import Path

    from triptych.accel.teacache_profile import find_profile

    try:
        meta = json.loads((Path(args.baseline) / "baseline.json").read_text())
        steps = meta["cases"][0]["steps"]
    except (OSError, ValueError, KeyError, IndexError):
        return {}  # load_baseline reports an unreadable baseline
    profile = find_profile(model, steps, meta.get("family"))
    return dict(profile.target) if profile is not None else {}


def _target(args, calibrated: dict | None = None) -> Target:
    """Flags given win; then the profile's calibrated target; then ``Target``'s defaults."""
    keys = ("min_psnr", "min_ssim", "max_adherence_drop", "min_motion_agreement")
    given = {k: getattr(args, k) for k in keys}
    values = {**vars(DEFAULT_TARGET), **(calibrated or {}), **{k: v for k, v in given.items() if v is not None}}
    try:
        return Target(**{k: values[k] for k in keys})
    except ValueError as e:
        raise InvalidParam("target", tuple(values.values()), str(e)) from None


def add_quality(sub) -> None:
    p = sub.add_parser(
        "quality", help="what an acceleration changes against the plain path or a stored baseline, with gates"
    )
    p.add_argument("--model", help="diffusers model directory (default: the built-in model)")
    p.add_argument(
        "--teacache-threshold",
        type=threshold_arg,
        nargs="+",
        metavar="T",
        help="TeaCache thresholds, or auto (the profile's recommendation); against the plain path, or "
        "with --baseline the configuration under test (one value)",
    )
    p.add_argument("--images", type=int, default=32, help="requests per setting (default 32)")
    p.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    p.add_argument(
        "--world",
        choices=["auto", "on", "off"],
        default="auto",
        help="score prompt adherence on held-out shape-world prompts (auto: when the model says it draws that world)",
    )
    p.add_argument("--prompt", action="append", help="generic prompts (repeatable) when not scoring the world")
    p.add_argument("--batch", type=int, default=1, help="requests per forward (default 1: each alone)")
    _add_target(p, "gate, exit 1 below it")
    p.add_argument("--no-gates", action="store_true", help="report only; never exit 1")
    p.add_argument("--out", help="also write the report: .json (everything) or .md (the table)")
    p.add_argument("--save-baseline", metavar="DIR", help="store fixed-seed outputs and latents of a matrix in DIR")
    p.add_argument("--baseline", metavar="DIR", help="compare the configuration under test with the baseline in DIR")
    p.add_argument("--matrix", help="YAML/JSON matrix for --save-baseline (default: a small one per family)")
    p.add_argument(
        "--exact-tolerance",
        type=float,
        default=None,
        help="--baseline, max-abs gates: largest allowed max abs pixel difference (default 0: identical; "
        "--served and parallel: their measured rounding tolerance)",
    )
    p.add_argument("--report", metavar="DIR", help="--baseline: write report.html/.json/.md into DIR")
    g = p.add_argument_group("--baseline: the configuration under test (one change at a time; gates in docs/cli.md)")
    g.add_argument(
        "--served", type=int, default=0, metavar="N", help="all cases at once through the serving engine, N per batch"
    )
    add_degree_flags(g)  # --cfg-parallel --ulysses --ring (spawned ranks)
    g.add_argument(
        "--gate",
        choices=["auto", "exact", "target"],
        default="auto",
        help="auto: exact for this code/dtype, a rounding tolerance for --served/parallel, the target for "
        "TeaCache; exact: max abs <= --exact-tolerance; target: --min-psnr/--min-ssim/--max-adherence-drop",
    )
    add_device_flags(p)
    add_threads_flag(p)
    from triptych.cli.accel_flags import add_speed_flags

    p.set_defaults(func=cmd_quality, check=check_quality, speed_flags=add_speed_flags(p))


def check_quality(args) -> None:
    """Before torch: the model directory, the counts, the target."""
    from triptych.cli.checks import at_least, check_common, check_parallel

    check_common(args)
    if args.images < 1:
        raise InvalidParam("images", args.images, "must be >= 1")
    at_least("steps", args.steps, 1)
    at_least("batch", args.batch, 1)
    at_least("served", args.served, 0)
    check_parallel(args)
    _target(args)


def cmd_quality(args) -> int:
    from triptych.families.models import resolve_model

    model = resolve_model(args.model, os.environ.get("TRIPTYCH_CACHE"))
    set_torch_threads(args.threads)
    if args.save_baseline or args.baseline:
        return _baseline_command(args, model, _target(args, _profile_target(model, args)))
    if not args.teacache_threshold:
        raise InvalidParam("teacache_threshold", None, "give thresholds (or auto), --save-baseline or --baseline")
    from triptych.calibration.quality import markdown, quality_report, write
    from triptych.cli.profiles import user_profiles_dir

    gates, target = not args.no_gates, _target(args)
    world = {"auto": None, "on": True, "off": False}[args.world]
    report = quality_report(
        model,
        args.teacache_threshold,
        images=args.images,
        steps=args.steps,
        world=world,
        prompts=args.prompt,
        profiles_dir=user_profiles_dir(model),
        min_psnr=target.min_psnr if gates else None,
        min_ssim=target.min_ssim if gates else None,
        max_adherence_drop=target.max_adherence_drop if gates else None,
        min_motion_agreement=target.min_motion_agreement if gates else None,
        batch_size=args.batch,
        progress=True,
        device=device_config_from_args(args),
    )
    print(markdown(report))
    if args.out:
        print(f"wrote {write(report, args.out)}")
    print("gates: " + ("passed" if report["passed"] else "FAILED"), file=sys.stderr)
    return 0 if report["passed"] else 1


def _parallel(args):
    """The ``--cfg-parallel/--ulysses/--ring`` degrees as a ``ParallelConfig``, or None for one rank."""
    from triptych.parallel import ParallelConfig

    try:
        config = ParallelConfig(cfg=args.cfg_parallel, ulysses=args.ulysses, ring=args.ring)
    except ValueError as e:
        raise InvalidParam(
            "--cfg-parallel/--ulysses/--ring", (args.cfg_parallel, args.ulysses, args.ring), str(e)
        ) from None
    return config if config.world_size > 1 else None


def _baseline_command(args, model, target: Target) -> int:
    from tqdm import tqdm

    from triptych.calibration import baseline
    from triptych.families.registry import load_family

    if args.save_baseline and args.baseline:
        raise InvalidParam("baseline", args.baseline, "give --save-baseline or --baseline, not both")
    thresholds = args.teacache_threshold or [0.0]
    if len(thresholds) != 1:
        raise InvalidParam("teacache_threshold", thresholds, "--baseline compares one configuration: give one value")
    from triptych.cli.accel_flags import speed_config

    device = device_config_from_args(args)
    speed = speed_config(args.speed_flags, args, args.parser, device.device, os.environ.get("TRIPTYCH_CACHE"))
    if args.save_baseline and speed.active:
        raise InvalidParam(
            "compile/quantize", speed.quantize or "--compile", "a baseline is the plain path: give them to --baseline"
        )
    family = load_family(model, device=device, speed=speed)
    if args.save_baseline:
        if thresholds[0]:
            raise InvalidParam("teacache_threshold", thresholds[0], "a baseline is the plain path; omit it")
        if args.served or max(args.cfg_parallel, args.ulysses, args.ring) > 1:
            raise InvalidParam("served/parallel", args.served, "a baseline is the plain path: give them to --baseline")
        matrix = baseline.load_matrix(args.matrix) if args.matrix else None
        bar = tqdm(desc="baseline", unit="case", file=sys.stderr)
        meta = baseline.save_baseline(args.save_baseline, model, family, matrix, progress=bar.update)
        bar.close()
        print(f"wrote baseline {args.save_baseline}: {len(meta['cases'])} cases, model {meta['model']['identity']}")
        return 0
    from triptych.calibration.baseline_report import markdown, write_reports

    tolerance = args.exact_tolerance
    if tolerance is not None and not tolerance >= 0:
        raise InvalidParam("exact_tolerance", tolerance, "must be >= 0")
    parallel = _parallel(args)
    bar = tqdm(desc="compare", unit="case", file=sys.stderr)
    report, outputs, tensors = baseline.compare_baseline(
        args.baseline,
        model,
        family,
        thresholds[0],
        target,
        tolerance,
        progress=bar.update,
        served=args.served,
        parallel=parallel,
        gate=args.gate,
    )
    bar.close()
    if args.no_gates:
        report["passed"] = True
    html = write_reports(args.report or "quality-report", report, outputs, tensors)
    print(markdown(report))
    print(f"wrote {html} (+ report.json, report.md)")
    return 0 if report["passed"] else 1
