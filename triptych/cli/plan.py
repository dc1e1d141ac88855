"""``triptych plan MODEL_DIR``: a request's FLOPs, weight bytes, activation peaks, ideal step times and
placement from the model's configs alone (``triptych.plan``); human-readable, or ``--json``."""

from __future__ import annotations

import json

from triptych.core.errors import InvalidParam


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="FLOPs, memory and placement of a request, from the model's configs alone")
    p.add_argument("model_dir", help="diffusers model directory (configs suffice: no weights, no tokenizers)")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int, help="video families: frames (default: the model's)")
    p.add_argument("--steps", type=int)
    p.add_argument("--guidance", type=float, help="CFG scale (Qwen-Image, Wan: > 1 runs two branches); FLUX: distilled")
    p.add_argument("--true-cfg", type=float, default=1.0, help="FLUX: > 1 runs a negative-prompt branch")
    p.add_argument("--batch", type=int, default=1, help="requests stacked in one forward")
    p.add_argument("--text-tokens", type=int, help="prompt tokens (Qwen-Image; FLUX and Wan pad to a fixed length)")
    p.add_argument("--negative-text-tokens", type=int, help="the negative prompt's tokens (default: --text-tokens)")
    p.add_argument("--devices", type=int, default=1, help="devices to place the roles on")
    p.add_argument("--device", default="H100", help="device kind from the peak table, or cpu (measured)")
    p.add_argument("--weights", choices=("bf16", "fp8", "int8"), default="bf16", help="weight format for the fit")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan, check=check_plan)


def check_plan(args) -> None:
    from triptych.plan.peaks import DEVICES

    for field in ("height", "width", "frames", "steps", "batch", "text_tokens", "negative_text_tokens", "devices"):
        v = getattr(args, field)
        if v is not None and v < 1:
            raise InvalidParam(f"--{field.replace('_', '-')}", v, "must be >= 1")
    if args.device.lower() != "cpu" and args.device not in DEVICES:
        raise InvalidParam("--device", args.device, f"must be cpu or one of {', '.join(DEVICES)}")


def cmd_plan(args) -> int:
    from triptych.plan.model_plan import Request, plan
    from triptych.plan.peaks import DEVICES, cpu_peak

    device = cpu_peak() if args.device.lower() == "cpu" else DEVICES[args.device]
    fields = (
        "height",
        "width",
        "frames",
        "steps",
        "guidance",
        "true_cfg",
        "batch",
        "text_tokens",
        "negative_text_tokens",
    )
    request = Request(**{f: getattr(args, f) for f in fields})
    out = plan(args.model_dir, request, devices=args.devices, device=device, weights=args.weights)
    print(json.dumps(out, indent=2) if args.json else render(out))
    return 0


def _si(n: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {prefix}{unit}"
    return f"{n:.4g} {unit}"


def _flops(d: dict) -> str:
    return _si(d["flops"], "FLOP") if "flops" in d else f"unknown ({d.get('unknown', '')})"


def _gb(n: int | None) -> str:
    return "unknown" if n is None else _si(n, "B")


def render(out: dict) -> str:
    from triptych.plan.peaks import DEVICES

    r = out["request"]
    lines = [
        f"{out['model']} ({out['family']}): {r['width']}x{r['height']}, {r['frames']} frame(s), {r['steps']} steps, "
        f"guidance {r['guidance']}, batch {r['batch']}, {r['branches']} branch(es), prompt tokens {r['text_tokens']}",
        "",
        "components (parameters, weights bf16 / fp8 / int8):",
    ]
    for name, c in out["components"].items():
        if "unknown" in c:
            lines.append(f"  {name:16} {c['role']:9} unknown ({c['unknown']})")
        else:
            w = c["weight_bytes"]
            lines.append(
                f"  {name:16} {c['role']:9} {_si(c['parameters'], '')}params, "
                f"{_gb(w['bf16'])} / {_gb(w['fp8'])} / {_gb(w['int8'])}"
            )
    s = out["stages"]
    lines += ["", "FLOPs (activation peak):"]
    for key, label in (
        ("transformer_forward", "transformer forward (1 row)"),
        ("denoise_step", "denoising step"),
        ("encode", "encode"),
        ("decode", "decode"),
    ):
        peak = s[key].get("activation_peak_bytes")
        lines.append(f"  {label:28} {_flops(s[key])}" + (f" ({_gb(peak)})" if peak is not None else ""))
    total = out["request_flops"]
    lines.append(f"  {'whole request':28} " + (_si(total, "FLOP") if total is not None else "unknown"))
    step = s["denoise_step"].get("flops")
    if step is not None:
        lines += ["", "ideal step time at dense peak (bf16 / fp8):"]
        for peak in (*DEVICES.values(), None):
            if peak is None:
                d = out["device"]
                if d["name"] in DEVICES:
                    break
                bf16, fp8 = d["peak_bf16_flops"], d["peak_fp8_flops"]
                name = d["name"]
            else:
                bf16, fp8, name = peak.bf16, peak.fp8, peak.name
            fp8_text = f"{step / fp8 * 1e3:.4g} ms" if fp8 else "no fp8"
            lines.append(f"  {name:28} {step / bf16 * 1e3:.4g} ms / {fp8_text}")
    p, d = out["placement"], out["device"]
    lines += [
        "",
        f"placement on {p['devices']} x {d['name']} ({_gb(d['memory_bytes'])} each, {d['weights']} weights): "
        + ("fits" if p["fits"] else f"does not fit ({p['why']})"),
        "  encoder + decoder on device 0" + (" beside a denoiser rank" if p["shares_with_denoiser"] else " alone"),
        f"  denoiser: {p['denoiser_devices']} device(s), CFG {p['cfg']} x Ulysses {p['ulysses']}, "
        f"{p['instances']} instance(s)",
    ]
    if p["unknown_components"]:
        lines.append(f"  not counted (unknown): {', '.join(p['unknown_components'])}")
    return "\n".join(lines)
