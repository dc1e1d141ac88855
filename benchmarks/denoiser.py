"""Denoiser throughput with continuous step batching vs sequential diffusers pipeline calls.

Same weights, prompts, seeds and steps. For concurrency N: Triptych encodes N requests, runs them
through one ``DenoiserEngine`` (all rows of a step in one forward, CFG fused) and decodes them;
the peer is N back-to-back ``pipe(...)`` calls. Reports images/s of each and their ratio, best of
``--repeats`` rounds measured alternately in the same process. On CPU, batching is expected to pay
little (compute-bound kernels); the table measures it rather than assuming it.

    python benchmarks/denoiser.py [--family flux] [--size tiny|small] [--concurrency 1 2 4 8] [--cfg]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# One compute thread and process CPU time: on a shared machine wall time swings several-fold between
# identical runs, CPU time of a single-threaded process does not.
torch.set_num_threads(1)
clock = time.process_time

from triptych.engine import DenoiserEngine, EngineConfig  # noqa: E402
from triptych.families.base import GenerationParams  # noqa: E402
from triptych.families.registry import load_family, make_tiny  # noqa: E402


def _requests(family, n: int, cfg: bool) -> list[GenerationParams]:
    out = []
    for i in range(n):
        p = GenerationParams(prompt=f"a red circle number {i} on a blue background", seed=i)
        if cfg:
            p = (
                p.replace(negative_prompt="blurry", true_cfg=3.0)
                if family.name == "flux"
                else p.replace(negative_prompt="blurry", guidance=4.0)
            )
        out.append(family.resolve(p))
    return out


def run_triptych(family, params: list[GenerationParams]) -> float:
    t = clock()
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=len(params), fuse_cfg=True))
    for i, p in enumerate(params):
        engine.add(family.prepare(f"r{i}", p, family.encode(p)))
    for s in engine.run_until_done():
        family.decode(s.latents, s.params)
    return clock() - t


def run_diffusers(family, params: list[GenerationParams]) -> float:
    t = clock()
    for p in params:
        family.reference_call(p)
    return clock() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="flux")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--concurrency", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cfg", action="store_true", help="requests use CFG (two rows each)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        family = load_family(make_tiny(args.family, tmp, size=args.size))
        print(
            f"{args.family} {args.size}, cfg={args.cfg}, torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        print("| concurrency | diffusers img/s | triptych img/s | ratio |")
        print("|---|---|---|---|")
        for n in args.concurrency:
            params = _requests(family, n, args.cfg)
            run_triptych(family, params[:1])  # warm-up
            ours = min(run_triptych(family, params) for _ in range(args.repeats))
            theirs = min(run_diffusers(family, params) for _ in range(args.repeats))
            print(f"| {n} | {n / theirs:.2f} | {n / ours:.2f} | {theirs / ours:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
