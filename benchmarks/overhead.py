"""Staged in-process generation vs the diffusers pipeline on the same weights, same run.

For each family and model size: build the seeded model once, then alternate diffusers
``pipe(...)`` and Triptych ``run_request`` (CFG branches as diffusers runs them, so the work is the
same) for ``--repeats`` rounds after a warm-up, and report the best CPU time (one thread) of each and
their ratio (Triptych / diffusers; target ≤ 1.02). The transformer's own time is measured on both
sides too: the work outside it (encode, scheduler, decode, glue) is where the two can differ, so
it is reported separately. Prints a markdown table.

    python benchmarks/overhead.py [--families flux qwen-image ...] [--sizes tiny small] [--repeats 5]
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

from triptych.engine.runner import run_request  # noqa: E402
from triptych.families.base import GenerationParams  # noqa: E402
from triptych.families.registry import load_family, make_tiny, tiny_names  # noqa: E402


def _params(family) -> GenerationParams:
    image = None
    if family.accepts_image:
        from PIL import Image

        image = Image.new("RGB", (64, 64), (200, 30, 30))
    return GenerationParams(
        prompt="a red circle on a blue background", negative_prompt="blurry", seed=0, image=image, guidance=None
    )


def measure(name: str, size: str, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        family = load_family(make_tiny(name, tmp, seed=0, size=size))
        p = _params(family)
        if name.startswith("flux"):
            p = p.replace(negative_prompt=None)
        p = family.resolve(p)
        transformer = family.pipe.transformer
        inside = [0.0]
        forward = transformer.forward

        def timed_forward(*args, **kwargs):
            t0 = clock()
            try:
                return forward(*args, **kwargs)
            finally:
                inside[0] += clock() - t0

        transformer.forward = timed_forward
        # Triptych's step may not call the transformer's forward (pipelines/<family>/fast.py): time the
        # family's forward instead; a transformer call inside it is then not counted twice.
        family_forward = family.forward

        def timed_family_forward(rows):
            t0, inner = clock(), forward
            try:
                transformer.forward = inner
                return family_forward(rows)
            finally:
                transformer.forward = timed_forward
                inside[0] += clock() - t0

        family.forward = timed_family_forward
        ours, theirs = [], []
        for i in range(repeats + 1):  # first round is warm-up
            for fn, out in (
                (lambda: family.reference_call(p), theirs),
                (lambda: run_request(family, p, fuse_cfg=False), ours),
            ):
                inside[0] = 0.0
                t = clock()
                fn()
                if i:
                    out.append((clock() - t, clock() - t - inside[0]))
        params = sum(x.numel() for x in transformer.parameters())
    d, o = min(theirs), min(ours)
    d_rest, o_rest = min(r for _, r in theirs), min(r for _, r in ours)
    return dict(
        family=name,
        size=size,
        params=params,
        steps=p.steps,
        diffusers_ms=d[0] * 1e3,
        triptych_ms=o[0] * 1e3,
        ratio=o[0] / d[0],
        diffusers_rest_ms=d_rest * 1e3,
        triptych_rest_ms=o_rest * 1e3,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=tiny_names())
    ap.add_argument("--sizes", nargs="*", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, process CPU time")
    print(
        "| family | size | transformer params | steps | diffusers CPU ms | triptych CPU ms | ratio "
        "| outside transformer: diffusers ms | triptych ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for name in args.families:
            r = measure(name, size, args.repeats)
            print(
                f"| {r['family']} | {r['size']} | {r['params'] / 1e6:.2f}M | {r['steps']} | {r['diffusers_ms']:.1f} "
                f"| {r['triptych_ms']:.1f} | {r['ratio']:.3f} | {r['diffusers_rest_ms']:.1f} | {r['triptych_rest_ms']:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
