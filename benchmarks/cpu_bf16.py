"""bfloat16 against float32 on this CPU, default model: is bf16 a speed path here? (issue 27 item 3)

The CPU has AVX512-BF16 (Zen 4), where oneDNN's bf16 matmul runs ~4x the fp32 rate. This measures
the matmul shapes of the default model's stack and of 1024², then the model: one request's fused-CFG
forward (2 rows) and eight requests' (16 rows), the per-image time of ``run_request`` and the PSNR
of eight bf16 images against their fp32 ones (uint8 pixels). One torch thread, process time, best of
5 rounds. ``--compile`` loads both families with ``SpeedConfig(compile=True)`` and warms them up.

    PYTHONPATH=$PWD python benchmarks/cpu_bf16.py [--compile] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from triptych.accel import SpeedConfig  # noqa: E402
from triptych.calibration.metrics import psnr  # noqa: E402
from triptych.engine.runner import run_request  # noqa: E402
from triptych.engine.warmup import warm_up  # noqa: E402
from triptych.families.base import COND, UNCOND, GenerationParams, Row  # noqa: E402
from triptych.families.models import default_model_dir  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402

DTYPES = ("float32", "bfloat16")


def best_ms(fn, n: int, rounds: int = 5) -> float:
    out = []
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(n):
            fn()
        out.append((time.process_time() - t) / n)
    return min(out) * 1e3


def params(family, i: int, prompt: str) -> GenerationParams:
    p = GenerationParams(prompt=prompt, seed=i, negative_prompt=" ", guidance=4.0, height=64, width=64)
    return family.resolve(p)


def rows_of(family, n: int) -> list[Row]:
    rows = []
    for i in range(n):
        p = params(family, i, f"object {i} on a plain background")
        state = family.prepare(f"q{i}", p, family.encode(p))
        rows += [Row(state, COND), Row(state, UNCOND)]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cache-dir", help="inductor cache directory (default: a fresh one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for m, k, n in ((496, 96, 288), (496, 384, 96), (1024, 1024, 1024)):
        cells = []
        for dt in DTYPES:
            a, b = torch.randn(m, k, dtype=getattr(torch, dt)), torch.randn(k, n, dtype=getattr(torch, dt))
            ms = best_ms(lambda a=a, b=b: a @ b, 20 if m == 1024 else 200)
            cells.append(f"{dt} {ms * 1e3:.1f} us ({2 * m * k * n / ms / 1e6:.0f} GFLOP/s)")
        print(f"matmul {m}x{k}x{n}: " + ", ".join(cells), flush=True)
    speed = SpeedConfig(compile=True, compile_cache_dir=args.cache_dir) if args.compile else SpeedConfig()
    images = {}
    for dt in DTYPES:
        family = load_family(default_model_dir(), dtype=dt, speed=speed)
        t = time.monotonic()
        if args.compile:
            warm_up(family)
        with torch.no_grad():
            r2, r16 = rows_of(family, 1), rows_of(family, 8)
            f2 = best_ms(lambda f=family, r=r2: f.forward(r), 50)
            f16 = best_ms(lambda f=family, r=r16: f.forward(r), 10)
        t = time.process_time()
        images[dt] = [run_request(family, params(family, 100 + i, f"a shape number {i}"))[0].array for i in range(8)]
        image_ms = (time.process_time() - t) / 8 * 1e3
        print(f"{dt}: forward 2 rows {f2:.2f} ms, 16 rows {f16:.2f} ms, image {image_ms:.0f} ms", flush=True)
    dbs = [psnr(b, a, data_range=255.0 if a.dtype == np.uint8 else 1.0) for a, b in zip(*images.values())]
    print("PSNR bf16 vs fp32 per image dB:", [round(float(d), 1) for d in dbs])


if __name__ == "__main__":
    main()
