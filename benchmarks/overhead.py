"""Staged in-process generation vs the diffusers pipeline on the same weights, same run.

For each family and model size: build the seeded model once, then alternate diffusers
``pipe(...)`` and Triptych ``run_request`` (CFG branches as diffusers runs them, so the work is the
same) for ``--repeats`` rounds after a warm-up, and report the median wall time of each and their
ratio (Triptych / diffusers; target ≤ 1.02). Prints a markdown table.

    python benchmarks/overhead.py [--families flux qwen-image ...] [--sizes tiny small] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from triptych.pipelines.base import GenerationParams  # noqa: E402
from triptych.pipelines.registry import TINY_MAKERS, load_family, make_tiny  # noqa: E402
from triptych.pipelines.runner import run_request  # noqa: E402


def _params(family) -> GenerationParams:
    image = None
    if family.accepts_image:
        from PIL import Image

        image = Image.new("RGB", (64, 64), (200, 30, 30))
    return GenerationParams(prompt="a red circle on a blue background", negative_prompt="blurry", seed=0,
                            image=image, guidance=None)  # fmt: skip


def measure(name: str, size: str, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        family = load_family(make_tiny(name, tmp, seed=0, size=size))
        p = _params(family)
        if name.startswith("flux"):
            p = p.replace(negative_prompt=None)
        p = family.resolve(p)
        ours, theirs = [], []
        for i in range(repeats + 1):  # first round is warm-up
            t = time.perf_counter()
            family.reference_call(p)
            d = time.perf_counter() - t
            t = time.perf_counter()
            run_request(family, p, fuse_cfg=False)
            o = time.perf_counter() - t
            if i:
                theirs.append(d)
                ours.append(o)
        params = sum(x.numel() for x in family.pipe.transformer.parameters())
    d, o = statistics.median(theirs), statistics.median(ours)
    return dict(family=name, size=size, params=params, steps=p.steps, diffusers_ms=d * 1e3, triptych_ms=o * 1e3,
                ratio=o / d)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=sorted(TINY_MAKERS))
    ap.add_argument("--sizes", nargs="*", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| family | size | transformer params | steps | diffusers ms | triptych ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for name in args.families:
            r = measure(name, size, args.repeats)
            print(f"| {r['family']} | {r['size']} | {r['params'] / 1e6:.2f}M | {r['steps']} | {r['diffusers_ms']:.1f} "
                  f"| {r['triptych_ms']:.1f} | {r['ratio']:.3f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
