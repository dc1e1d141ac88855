"""``plan``: what one request of a size costs a model, from its configs alone (no weights, no
tokenizers): FLOPs of a transformer forward, a denoising step (CFG branches stacked as the engine
fuses them), the encode and the decode; weight bytes per component and format; activation peaks;
ideal times at a device's peak; and whether and how it fits one or N devices."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from triptych.core.kinds import Role
from triptych.families.base import COND, UNCOND, GenerationParams
from triptych.families.geometry import model_defaults
from triptych.families.registry import family_class
from triptych.plan import components as comp
from triptych.plan import stages
from triptych.plan.inputs import geometry
from triptych.plan.peaks import DEVICES, Peak
from triptych.plan.placement import place
from triptych.plan.trace import Count

#: prompt tokens assumed for a Qwen-Image prompt when none is given (its prompts are not padded)
QWEN_TEXT_TOKENS = 128
#: the families' pipeline defaults, for a model whose ``triptych.json`` does not set them
FALLBACKS = {
    "flux": {"height": 1024, "width": 1024, "frames": 1, "steps": 28, "guidance": 3.5},
    "qwen-image": {"height": 1024, "width": 1024, "frames": 1, "steps": 50, "guidance": 4.0},
    "wan": {"height": 480, "width": 832, "frames": 81, "steps": 50, "guidance": 5.0},
}


@dataclass(frozen=True)
class Request:
    """The size planned for; None: the model's default."""

    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None
    true_cfg: float = 1.0  # FLUX's true CFG (a negative prompt with true_cfg > 1 runs two branches)
    batch: int = 1
    text_tokens: int | None = None  # prompt tokens (Qwen-Image); None: fixed by padding, or QWEN_TEXT_TOKENS
    negative_text_tokens: int | None = None  # the negative prompt's; None: as text_tokens


def _fallback(family: str) -> dict:
    return FALLBACKS["wan" if family.startswith("wan") else "qwen-image" if family.startswith("qwen") else family]


def resolve(model_dir: Path, family: str, r: Request) -> Request:
    defaults = {**_fallback(family), **model_defaults(model_dir)}
    return replace(
        r, **{k: defaults[k] for k in ("height", "width", "frames", "steps", "guidance") if getattr(r, k) is None}
    )


def branches(family: str, r: Request, fixed_tokens: int | None) -> dict[str, int]:
    """Branch → its prompt tokens: two branches where the request runs CFG."""
    cfg = r.true_cfg > 1 if family == "flux" else r.guidance > 1
    cond = fixed_tokens or r.text_tokens or QWEN_TEXT_TOKENS
    out = {COND: cond}
    if cfg:
        out[UNCOND] = fixed_tokens or r.negative_text_tokens or cond
    return out


def _count(c) -> dict[str, int]:
    return {"flops": c.flops, "activation_peak_bytes": c.peak_bytes}


def _try(fn) -> dict[str, Any]:
    try:
        return _count(fn())
    except Exception as e:  # noqa: BLE001 - a module this torch cannot run on meta is unknown, not an error
        return {"unknown": f"{type(e).__name__}: {e}"}


def plan(
    model_dir: str | Path,
    request: Request = Request(),
    devices: int = 1,
    device: Peak = DEVICES["H100"],
    weights: str = "bf16",
) -> dict[str, Any]:
    """The plan as plain data (the ``--json`` output). Unknown components are reported, not raised."""
    model_dir = Path(model_dir)
    cls = family_class(model_dir)
    r = resolve(model_dir, cls.name, request)
    vae_cfg = comp.read_config(model_dir / "vae" / "config.json")
    g = geometry(cls.name, model_dir, vae_cfg, model_defaults(model_dir), cls.requires_image)
    text = branches(cls.name, r, g.text_tokens)
    params = GenerationParams(
        prompt="plan",
        height=r.height,
        width=r.width,
        frames=r.frames,
        steps=r.steps,
        guidance=r.guidance,
        true_cfg=r.true_cfg,
    )
    roles = {
        role: [
            n
            for n in cls.role_components[role]
            if "token" not in n and "processor" not in n and "feature_extractor" not in n
        ]
        for role in (Role.ENCODER, Role.DENOISER, Role.DECODER)
    }
    if not cls.requires_image:
        roles[Role.ENCODER] = [n for n in roles[Role.ENCODER] if n != "image_encoder"]
    out: dict[str, Any] = {
        "model": str(model_dir),
        "family": cls.name,
        "request": {
            **{k: getattr(r, k) for k in ("height", "width", "frames", "steps", "guidance", "true_cfg", "batch")},
            "branches": len(text),
            "text_tokens": text,
        },
        "components": {},
        "stages": {},
    }
    built = {}
    for role, names in roles.items():
        for name in names:
            c = comp.load(model_dir, name)
            built[name] = c
            entry: dict[str, Any] = {"role": str(role), "class": c.cls_name}
            if c.unknown:
                entry["unknown"] = c.unknown
            else:
                entry.update(parameters=c.params, weight_bytes=c.weight_bytes())
            out["components"][name] = entry
    t = built.get("transformer")
    if t is not None and t.module is not None:
        one = _try(lambda: stages.transformer_forward(t.module, g, params, {COND: text[COND]}))
        same = len(text) == 1 and r.batch == 1  # the step is that one forward: not traced again
        step = one if same else _try(lambda: stages.transformer_forward(t.module, g, params, text, r.batch))
        out["stages"]["transformer_forward"] = one
        out["stages"]["denoise_step"] = step
    else:
        out["stages"]["transformer_forward"] = out["stages"]["denoise_step"] = {"unknown": "no transformer config"}
    encode: dict[str, Any] = {}
    for name in roles[Role.ENCODER]:
        c = built[name]
        if c.config is not None and "model_type" not in c.config:
            continue  # a diffusers model in the encoder role (edit's VAE encode of the condition image): not counted
        encode[name] = {"unknown": c.unknown} if c.unknown else _try(lambda c=c: _encode(c.module, g, text, r.batch))
    out["stages"]["encode"] = _sum(encode)
    vae = built.get("vae")
    out["stages"]["decode"] = (
        _try(lambda: stages.vae_decode(vae.module, g, params, r.batch))
        if vae is not None and vae.module is not None
        else {"unknown": "no vae config"}
    )
    out["request_flops"] = _request_flops(out["stages"], r.steps)
    out["device"] = _device(out, device, r.steps, weights)
    out["placement"] = _placement(out, roles, device, devices, weights, len(text), t)
    return out


def _encode(module, g, text: dict[str, int], batch: int):
    """Every branch's prompts through one encoder, each at its own length."""
    counts = [stages.encoder_forward(module, g, tokens, batch) for tokens in text.values()]
    return Count(sum(c.flops for c in counts), max(c.peak_bytes for c in counts))


def _sum(parts: dict[str, dict]) -> dict[str, Any]:
    known = [p for p in parts.values() if "flops" in p]
    out: dict[str, Any] = {"components": parts}
    if known:
        out["flops"] = sum(p["flops"] for p in known)
        out["activation_peak_bytes"] = max(p["activation_peak_bytes"] for p in known)
    if len(known) < len(parts):
        out["unknown"] = ", ".join(n for n, p in parts.items() if "flops" not in p)
    return out


def _request_flops(s: dict, steps: int) -> int | None:
    """Encode + steps × step + decode; None when the step is unknown (unknown encode/decode count 0)."""
    if "flops" not in s["denoise_step"]:
        return None
    return s["encode"].get("flops", 0) + steps * s["denoise_step"]["flops"] + s["decode"].get("flops", 0)


def _device(out: dict, peak: Peak, steps: int, weights: str) -> dict[str, Any]:
    step = out["stages"]["denoise_step"].get("flops")
    times = {}
    if step is not None:
        times = {"bf16": step / peak.bf16, "fp8": step / peak.fp8 if peak.fp8 else None}
    return {
        "name": peak.name,
        "peak_bf16_flops": peak.bf16,
        "peak_fp8_flops": peak.fp8,
        "memory_bytes": peak.memory,
        "ideal_step_seconds": times,
        "weights": weights,
    }


def _role_bytes(out: dict, names: list[str], weights: str) -> int:
    return sum(out["components"][n].get("weight_bytes", {}).get(weights, 0) for n in names)


def _placement(out: dict, roles: dict, peak: Peak, devices: int, weights: str, branches: int, t) -> dict[str, Any]:
    s = out["stages"]
    enc_dec = _role_bytes(out, roles[Role.ENCODER] + roles[Role.DECODER], weights) + max(
        s["encode"].get("activation_peak_bytes", 0), s["decode"].get("activation_peak_bytes", 0)
    )
    heads = int(t.config.get("num_attention_heads", 1)) if t is not None and t.config else 1
    p = place(
        peak.memory,
        devices,
        enc_dec,
        _role_bytes(out, roles[Role.DENOISER], weights),
        s["denoise_step"].get("activation_peak_bytes", 0),
        branches,
        heads,
    )
    unknown = [n for n, c in out["components"].items() if "unknown" in c]
    return {**p.to_dict(), "unknown_components": unknown}
