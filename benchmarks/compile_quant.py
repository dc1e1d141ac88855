"""``--compile`` and ``--quantize`` on the default model, in process, against eager float32, same run.

Variants (one family each, loaded once): eager float32, ``--compile``, ``--quantize
transformer=int8-weight-only``, ``--quantize transformer=int8-dynamic``, and ``--compile`` with
each. Compiled ones are warmed up first (``engine/warmup.py``: compile time is not in the
figures; it is printed). Then, for ``--repeats`` rounds, every variant in turn runs
(a) one image through ``run_request`` (20 steps, fused CFG, 64x64) and (b) ``--forwards``
transformer forwards of one request's two CFG rows, prepared by that variant's family (as a served
request's are: ``--compile`` reads each step's timestep embedding and modulation from tables its
``prepare`` computed). Reported: the best CPU time of each (one thread, process time), the ratio to
eager, the output difference to eager beside it (max abs and PSNR of the image), and the forward's
share of the machine's measured fp32 matmul rate (FLOPs of the eager forward from
``torch.utils.flop_counter``, less what a compiled forward reads from those tables, / time / the
1024x1024 matmul rate on one thread).

(c) 10 VAE decodes of the same latents ("decode ms", per decode; ``--compile`` compiles the decoder where the
family's ``compile_vae_decoder`` says it pays), and, as the peer of (a), diffusers' own eager
``__call__`` of the same request on the eager family's pipeline (its row: "diffusers __call__"), and
diffusers with its own best exact option applied to a pipeline of its own: the transformer's
``compile_repeated_blocks()`` (diffusers' regional compile) and its VAE decoder compiled with
``torch.compile`` (row: "diffusers compiled"; ``--no-diffusers-compiled`` leaves it out). torchao int8
is left out of that peer: it is slower than float32 at this model's size (the int8 rows show it).

    python benchmarks/compile_quant.py [--repeats 5] [--forwards 20] [--cache-dir DIR] [--variants compile ...]
    python benchmarks/compile_quant.py --device cuda ...   # on a GPU: wall time, synchronized (gpu_check.sh)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
clock = time.process_time  # on CPU; --device cuda: wall time around a synchronize (``_use_device``)
sync = None
# NOTE: the compiled variants share the stack's and the block class's code objects, so their graphs
# (2 of the stack each, the quantized ones on the regional blocks, which guard on other weight types)
# add up in this one process past dynamo's default limit of 8, which would silently run the rest
# eager. A worker holds one family: 2 stack graphs.
torch._dynamo.config.recompile_limit = 64

from triptych.accel import SpeedConfig  # noqa: E402
from triptych.calibration.metrics import psnr  # noqa: E402
from triptych.engine.runner import run_request  # noqa: E402
from triptych.engine.warmup import warm_up, warm_up_decoder  # noqa: E402
from triptych.families.base import COND, UNCOND, GenerationParams, Row  # noqa: E402
from triptych.families.models import default_model_dir  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402

VARIANTS = {
    "eager fp32": dict(),
    "--compile": dict(compile=True),
    "int8 weight-only": dict(quantize=("transformer=int8-weight-only",)),
    "int8 dynamic": dict(quantize=("transformer=int8-dynamic",)),
    "--compile + int8 weight-only": dict(compile=True, quantize=("transformer=int8-weight-only",)),
    "--compile + int8 dynamic": dict(compile=True, quantize=("transformer=int8-dynamic",)),
}
PROMPT = "a red circle on a blue background"


def _use_device(device: str) -> None:
    global clock, sync
    if torch.device(device).type == "cuda":
        clock, sync = time.perf_counter, torch.cuda.synchronize


def matmul_gflops(n: int = 1024, repeats: int = 10, device: str = "cpu") -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    if sync:
        sync()
    t = clock()
    fn()
    if sync:
        sync()
    return clock() - t


def forward_flops(family, rows) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        family.forward(rows)
    return counter.get_total_flops()


def table_flops(family, state) -> float:
    """FLOPs per row and step of what a compiled forward reads from the tables ``prepare`` computed
    (``FastForward.schedule``: the timestep embedding, every block's modulation, ``norm_out``'s)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        family._fast.schedule(state)
    return counter.get_total_flops() / len(state.timesteps)


def diffusers_compiled(params, device: str = "cpu"):
    """A family of its own whose diffusers pipeline has diffusers' regional compile on the transformer
    and ``torch.compile`` on the VAE decoder, warmed up by one ``__call__``."""
    family = load_family(default_model_dir(), device=device, dtype="float32")
    family.pipe.transformer.compile_repeated_blocks()
    family.pipe.vae.decoder.compile()
    family.reference_call(params)
    return family


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=20)
    ap.add_argument("--cache-dir", help="inductor cache (default: a fresh temporary directory: cold compiles)")
    ap.add_argument(
        "--variants", nargs="+", metavar="NAME", help="variants to run beside eager fp32, '--' of a name left out"
    )
    ap.add_argument("--no-diffusers-compiled", action="store_true", help="leave out the compiled diffusers peer")
    ap.add_argument("--device", default="cpu", help="cpu (process time, one thread) or cuda (synchronized wall time)")
    args = ap.parse_args(argv)
    _use_device(args.device)
    wanted = [v if v in VARIANTS else f"--{v}" for v in args.variants or VARIANTS]
    if unknown := [v for v in wanted if v not in VARIANTS]:
        ap.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    names = ["eager fp32"] + [n for n in wanted if n != "eager fp32"]
    cache = args.cache_dir or tempfile.mkdtemp(prefix="triptych-inductor-")
    families, compile_s = {}, {}
    for name in names:
        kw = VARIANTS[name]
        t = time.perf_counter()
        speed = SpeedConfig(**kw, compile_cache_dir=cache if kw.get("compile") else None)
        families[name] = family = load_family(default_model_dir(), device=args.device, dtype="float32", speed=speed)
        if speed.compile:
            warm_up(family)
            warm_up_decoder(family)
        compile_s[name] = time.perf_counter() - t
    params = families["eager fp32"].resolve(GenerationParams(prompt=PROMPT, seed=0))
    peers = {"diffusers __call__": families["eager fp32"]}
    if not args.no_diffusers_compiled:
        t = time.perf_counter()
        peers["diffusers compiled"] = diffusers_compiled(params, args.device)
        compile_s["diffusers compiled"] = time.perf_counter() - t
    eager = families["eager fp32"]
    state = eager.prepare("bench", params, eager.encode(params))
    rows = [Row(state, COND), Row(state, UNCOND)]
    flops = forward_flops(eager, rows)
    moved = 2 * table_flops(eager, state)  # the two rows' share of the tables
    own_rows, own_flops = {}, {}
    for name, family in families.items():
        own = family.prepare("bench", params, family.encode(params))
        own_rows[name] = [Row(own, COND), Row(own, UNCOND)]
        own_flops[name] = flops - moved if getattr(own.step_consts, "schedule", None) is not None else flops
    rate = matmul_gflops(device=args.device)
    denoised = eager.prepare("bench-decode", params, eager.encode(params))
    while not denoised.done:
        eager.denoise_step([denoised])
    images, image_s, forward_s = {}, {n: [] for n in families}, {n: [] for n in families}
    decode_s, peer_s = {n: [] for n in families}, {n: [] for n in peers}
    peer_img = {n: f.reference_call(params) for n, f in peers.items()}  # warm-up round (first calls, caches)
    for name, family in families.items():
        images[name] = run_request(family, params)[0].array
    for _ in range(args.repeats):
        for name, family in peers.items():
            peer_s[name].append(_timed(lambda f=family: f.reference_call(params)))
        for name, family in families.items():
            image_s[name].append(_timed(lambda f=family: run_request(f, params)))
            with torch.no_grad():
                fwd_rows = own_rows[name]
                forward_s[name].append(
                    _timed(lambda f=family, r=fwd_rows: [f.forward(r) for _ in range(args.forwards)])
                )
            decode_s[name].append(_timed(lambda f=family: [f.decode(denoised.latents, params) for _ in range(10)]) / 10)
    base_img, base_fwd = min(image_s["eager fp32"]), min(forward_s["eager fp32"]) / args.forwards
    print(
        f"matmul 1024x1024 fp32 on {args.device} (one thread on CPU): {rate:.1f} GFLOP/s; transformer forward (2 rows): "
        f"{flops / 1e6:.1f} MFLOP, {(flops - moved) / 1e6:.1f} reading the schedule tables"
    )
    print(
        "| variant | setup s (compile+warm-up) | image ms | vs eager | vs diffusers __call__ | forward ms | vs eager | "
        "decode ms | share of matmul rate | max abs vs eager | PSNR vs eager dB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base_peer = min(peer_s["diffusers __call__"])
    for name in peers:
        t_peer = min(peer_s[name])
        diff = float(np.abs(peer_img[name] - images["eager fp32"]).max())
        print(
            f"| {name} | {compile_s.get(name, 0):.1f} | {t_peer * 1000:.0f} | {base_img / t_peer:.2f}x | "
            f"{base_peer / t_peer:.2f}x | - | - | - | - | {diff:.1e} | {psnr(peer_img[name], images['eager fp32']):.1f} |"
        )
    for name in families:
        img, fwd = min(image_s[name]), min(forward_s[name]) / args.forwards
        diff = float(np.abs(images[name] - images["eager fp32"]).max())
        share = own_flops[name] / fwd / (rate * 1e9)
        p = psnr(images[name], images["eager fp32"])
        print(
            f"| {name} | {compile_s[name]:.1f} | {img * 1000:.0f} | {base_img / img:.2f}x | {base_peer / img:.2f}x | "
            f"{fwd * 1000:.2f} | {base_fwd / fwd:.2f}x | {min(decode_s[name]) * 1000:.1f} | {share * 100:.1f}% | "
            f"{diff:.1e} | {p:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
