"""The ``triptych`` command line: generate, chat, make-tiny, calibrate, quality, serve, worker.

User errors (``InvalidParam``, ``UnknownModel``) print one line and exit with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from triptych.cli import checks as cli_checks
from triptych.cli.accel_flags import add_speed_flags, speed_config
from triptych.cli.worker_flags import add_degree_flags
from triptych.core.config_flags import ConfigFlags
from triptych.core.devices import add_device_flags, add_threads_flag, device_config_from_args, set_torch_threads
from triptych.core.errors import InvalidParam, UnknownModel

EXIT_USAGE = 2
#: ``GenerationParams`` fields ``generate`` has a flag for (``--image`` and ``--lora`` are read as files
#: and names, not values; ``tenant`` and ``lora_paths`` are the server's).
GENERATE_FIELDS = (
    "prompt",
    "negative_prompt",
    "height",
    "width",
    "frames",
    "steps",
    "guidance",
    "seed",
    "true_cfg",
    "teacache_threshold",
)


def _add_mm_cache_mb(p) -> None:
    """``--mm-cache-mb`` from ``MMCacheConfig.max_mb``; the environment is read here, as the flag's
    default, never in the library."""
    from triptych.mmcache.config import FLAG_NAMES, MMCacheConfig

    ConfigFlags(p, MMCacheConfig, only=("max_mb",), rename=FLAG_NAMES)
    if os.environ.get("TRIPTYCH_MM_CACHE_MB"):
        p.set_defaults(mm_cache_mb=float(os.environ["TRIPTYCH_MM_CACHE_MB"]))


def _mm_cache_config(args):
    from triptych.mmcache.cache import MMCacheConfig

    try:
        return MMCacheConfig(max_mb=args.mm_cache_mb)
    except ValueError:
        raise InvalidParam("mm_cache_mb", args.mm_cache_mb, "must be a finite number of MiB >= 0 (0 = off)") from None


def _add_generate(sub) -> None:
    from triptych.families.params import GenerationParams

    p = sub.add_parser("generate", help="run one generation in this process")
    p.add_argument("--model", help="diffusers model directory (default: the built-in model)")
    p.add_argument("--image", help="condition image (edit / image-to-video families)")
    ConfigFlags(  # the request's own flags, from GenerationParams (cmd_generate reads them back by name)
        p,
        GenerationParams,
        only=GENERATE_FIELDS,
        parse={"teacache_threshold": _threshold_arg},
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME_OR_DIR[:SCALE]",
        help="a LoRA adapter (diffusers format: a folder or .safetensors file, or the name of one the model "
        "ships in its lora/ folder, e.g. invert or resize on the default model) and its scale (default 1); "
        "repeat to stack several",
    )
    p.add_argument("--fps", type=int, default=16, help="MP4 frame rate")
    p.add_argument(
        "--no-limits",
        action="store_true",
        help="lift the server's admission limits (size, steps, frames, transformer tokens; see docs/api.md), "
        "knowing that a request past them may run for hours and out of memory",
    )
    p.add_argument(
        "--separate-cfg",
        action="store_true",
        help="run CFG branches as separate forwards, as diffusers does (bit-identical to it); "
        "default: one fused forward, as the serving engine runs them",
    )
    p.add_argument("--out", required=True, help="output file: .png .jpg .webp (images) or .mp4 (video)")
    _add_mm_cache_mb(p)
    add_device_flags(p)
    add_threads_flag(p)
    p.set_defaults(speed_flags=add_speed_flags(p))
    g = p.add_argument_group("multi-rank denoiser (this process is rank 0 and spawns the others)")
    add_degree_flags(g)
    p.set_defaults(func=cmd_generate, check=cli_checks.check_generate)


def _parallel_config(args):
    from triptych.parallel import ParallelConfig

    try:
        return ParallelConfig(cfg=args.cfg_parallel, ulysses=args.ulysses, ring=args.ring)
    except ValueError as e:
        raise InvalidParam(
            "--cfg-parallel/--ulysses/--ring", (args.cfg_parallel, args.ulysses, args.ring), str(e)
        ) from None


def _threshold_arg(text: str) -> float:
    from triptych.cli.calibration import threshold_arg

    return threshold_arg(text)


def _add_make_tiny(sub) -> None:
    from triptych.families.registry import tiny_names

    p = sub.add_parser("make-tiny", help="write a seeded tiny diffusers model directory")
    p.add_argument("--family", required=True, choices=tiny_names())
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.set_defaults(func=cmd_make_tiny)


def cmd_generate(args) -> int:
    import time

    from tqdm import tqdm

    from triptych.core.media import encode_frames
    from triptych.core.progress import DONE, progress_percent
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.models import resolve_model
    from triptych.families.registry import load_family

    device = device_config_from_args(args)
    fmt, image = args.out_format, args.image_rgb  # checked before torch loaded (cli_checks.check_generate)
    parallel = _parallel_config(args)
    threads = set_torch_threads(args.threads, parallel.world_size)
    cache_root = os.environ.get("TRIPTYCH_CACHE")
    speed = speed_config(args.speed_flags, args, args.parser, device.device, cache_root)
    params = GenerationParams(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        frames=args.frames,
        steps=args.steps,
        guidance=args.guidance,
        true_cfg=args.true_cfg,
        seed=args.seed,
        image=image,
        teacache_threshold=args.teacache_threshold,
    )
    t0 = time.perf_counter()
    family = load_family(
        resolve_model(args.model, cache_root),
        device=device,
        mm_cache_config=_mm_cache_config(args),
        speed=speed,
    )
    load_s = time.perf_counter() - t0
    params = family.resolve(params)
    from triptych.cli.limits import check_resolved

    check_resolved(family, params, args.no_limits)
    from triptych.cli.notes import warn_of_request

    warn_of_request(family, params)
    if args.lora:
        params = _with_lora(family, params, args.lora)
    accel = None
    if params.teacache_threshold:
        accel = _teacache(family, params)
    if family.is_video != (fmt == "mp4"):
        raise InvalidParam("out", args.out, "video families write .mp4; image families write .png/.jpg/.webp")
    # the progress a served video job reports (triptych.core.progress): steps fill 90%, the decode the rest
    bar = tqdm(total=DONE, desc="denoising", unit="%", file=sys.stderr, bar_format="{l_bar}{bar}| {n}/{total}%")
    from triptych.cli.estimate import StepEstimate

    estimate = StepEstimate(lambda line: bar.write(line, file=sys.stderr))

    def on_step(state) -> None:
        estimate.step(state.step, state.total_steps)
        bar.update(progress_percent(state.step, state.total_steps) - bar.n)
        if state.done:
            bar.set_description("decoding")

    estimate.started()
    if parallel.world_size > 1:
        from triptych.worker.ranks.local import run_parallel_request

        frames, timings = run_parallel_request(
            family, params, parallel, device=device.device, on_step=on_step, threads=threads
        )
    else:
        frames, timings = run_request(family, params, on_step=on_step, fuse_cfg=not args.separate_cfg, accel=accel)
    t = time.perf_counter()
    data = encode_frames(frames.to_uint8(), fmt, fps=args.fps)
    with open(args.out, "wb") as f:
        f.write(data)
    timings.seconds["write"] = time.perf_counter() - t
    bar.update(DONE - bar.n)
    bar.close()
    stages = "  ".join(f"{k} {v * 1000:.0f} ms" for k, v in {"load": load_s, **timings.seconds}.items())
    print(f"wrote {args.out} ({family.name}, {params.width}x{params.height}, {params.steps} steps, seed {params.seed})")
    print(f"timings: {stages}")
    return 0


def _with_lora(family, params, values):
    from triptych.lora.config import lora_args

    config, spec = lora_args(values, shipped=family.model_dir / "lora")
    if params.teacache_threshold:
        raise InvalidParam("teacache_threshold", params.teacache_threshold, "must be 0 with --lora")
    family.enable_lora(config)
    return params.replace(lora=spec)


def _teacache(family, params):
    """The TeaCache of a ``generate``: profiles from this user's directory first, then the model's
    shipped ones (``cli_profiles``); ``auto`` says which profile and threshold it took."""
    from triptych.accel.teacache_profile import AUTO_THRESHOLD
    from triptych.cli.profiles import describe_auto, user_profiles_dir
    from triptych.engine.teacache import make_teacache
    from triptych.families.teacache_check import check_teacache

    profiles_dir = user_profiles_dir(family.model_dir)
    check_teacache(family, params, profiles_dir)
    accel = make_teacache(family, profiles_dir)
    if params.teacache_threshold == AUTO_THRESHOLD:
        line = describe_auto(accel.resolve(AUTO_THRESHOLD, params.steps))
        logging.getLogger("triptych.cli").info(line)
        print(line)
    return accel


def _add_chat(sub) -> None:
    from triptych.core.chat_sampling import ChatSampling

    p = sub.add_parser("chat", help="ask the model's VLM about images, in this process (streams the answer)")
    p.add_argument("--prompt", required=True, help='the question, e.g. "What is in this image?"')
    p.add_argument(
        "--image", action="append", default=[], help="an image file (repeat for several; shown before the question)"
    )
    p.add_argument("--model", help="model directory (default: the built-in model)")
    p.add_argument("--system", help="system message")
    ConfigFlags(p, ChatSampling)  # --max-tokens, --temperature, --top-p, --seed
    _add_mm_cache_mb(p)
    add_device_flags(p)
    add_threads_flag(p)
    p.set_defaults(func=cmd_chat, check=cli_checks.check_chat)


def cmd_chat(args) -> int:
    from triptych.chat import ChatParams, ChatTurn
    from triptych.core.kinds import Role
    from triptych.families.models import resolve_model
    from triptych.families.registry import family_class

    device = device_config_from_args(args)
    set_torch_threads(args.threads)
    images = args.images_rgb  # read and decoded before torch loaded (cli_checks.check_chat)
    turns = ((ChatTurn("system", (args.system,)),) if args.system else ()) + (
        ChatTurn("user", (*range(len(images)), args.prompt)),
    )
    params = ChatParams(
        turns, tuple(images), max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    params.check(max_images=64)
    model_dir = resolve_model(args.model, os.environ.get("TRIPTYCH_CACHE"))
    family = family_class(model_dir)(
        model_dir, roles={Role.ENCODER}, device=device, mm_cache_config=_mm_cache_config(args)
    )
    chat = family.chat_model()
    if chat is None:
        raise InvalidParam("model", str(model_dir), f"({family.name}) has no VLM to chat with (no processor/)")
    result = chat.run(params, on_text=lambda piece: print(piece, end="", flush=True))
    print()
    print(
        f"({result.prompt_tokens} prompt + {result.completion_tokens} completion tokens, {result.finish_reason})",
        file=sys.stderr,
    )
    return 0


def _add_calibrate(sub) -> None:
    from triptych.cli.calibration import add_calibrate

    add_calibrate(sub)  # flags and command: triptych/cli/calibration.py


def _add_quality(sub) -> None:
    from triptych.cli.calibration import add_quality

    add_quality(sub)  # flags and command: triptych/cli/calibration.py


def _add_plan(sub) -> None:
    from triptych.cli.plan import add_plan

    add_plan(sub)  # flags and command: triptych/cli/plan.py


def cmd_make_tiny(args) -> int:
    from triptych.families.registry import make_tiny

    out = make_tiny(args.family, args.out, seed=args.seed, size=args.size)
    print(f"wrote tiny {args.family} ({args.size}, seed {args.seed}) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triptych", description="Disaggregated diffusion serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_chat(sub)
    _add_make_tiny(sub)
    _add_calibrate(sub)
    _add_quality(sub)
    _add_plan(sub)
    try:
        from triptych.cli.serve import add_server_commands
    except ImportError:
        pass
    else:
        add_server_commands(sub)
    for sub_parser in sub.choices.values():
        sub_parser.set_defaults(parser=sub_parser)  # main: its errors show its own usage
    return parser


def _quiet_libraries() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's INFO lines (serve sets its workers' own)
    parser = build_parser()
    from triptych.cli.flag_suggest import name_misspelt_flags

    name_misspelt_flags(parser, sys.argv[1:] if argv is None else list(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a misspelt flag of a subcommand: that subcommand's usage, not the top level's, and its closest flag
        from triptych.cli.flag_suggest import unknown_flags_message

        command = getattr(args, "parser", parser)
        command.error(unknown_flags_message(command, unknown))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:  # transformers imports torchao whenever it is installed; on import it warns that
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA / Triton kernels are absent,
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # and torch that its enums register
    try:
        if getattr(args, "check", None) is not None:
            args.check(args)  # before torch is imported: a bad argument is an error in about a second
        _quiet_libraries()
        return args.func(args)
    except (InvalidParam, UnknownModel) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if argv is None:  # the command itself, about to exit (not a caller of main in its own process)
            _leave_heap_to_exit()


def _leave_heap_to_exit() -> None:
    """Freeze the heap so interpreter shutdown does not sweep it: the garbage collector's passes over
    what torch, diffusers and transformers loaded (thousands of modules) are a visible part of a
    ``generate``'s exit (benchmarks/RESULTS.md, cold start). Output is already written and flushed or closed; atexit
    handlers still run; the memory goes back to the OS with the process."""
    import gc

    gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
