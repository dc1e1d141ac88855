"""Different LoRAs in one batch vs grouping by adapter vs merging weights per request, and the cost of
an adapter against none: the default model's denoiser, in one process.

Eight requests over four random adapters (two each; rank ``--rank`` on the attention and MLP
projections, diffusers format), CFG on, the model's default size. Denoising only (the conditioning
is encoded once beforehand; encode and decode are the same in every mode):

- ``mixed``: one ``DenoiserEngine`` steps all eight together (one forward per step, per-row deltas).
- ``grouped``: one batch per adapter, run one after another (a server that batches only requests
  sharing an adapter, e.g. vLLM-Omni's one adapter per batch).
- ``merged``: each request alone with its adapter merged into the weights (W += s·B·A) and unmerged
  after (a server that merges adapters, e.g. SGLang's, serving them one request at a time).
- ``none``: the eight requests in one batch without adapters (the cost of an adapter vs none).

Rounds alternate the modes; one warm-up round, then the best of ``--repeats``; one torch thread,
process CPU time (wall time swings several-fold on a shared machine).

    python benchmarks/lora.py [--repeats 3] [--steps 8] [--rank 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
clock = time.process_time

from triptych.engine import DenoiserEngine, EngineConfig  # noqa: E402
from triptych.families.base import GenerationParams  # noqa: E402
from triptych.families.models import resolve_model  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402
from triptych.lora.config import LoraConfig  # noqa: E402
from triptych.lora.synthetic import write_random_lora  # noqa: E402

TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.net.0.proj", "img_mlp.net.2")
ADAPTERS = ("a", "b", "c", "d")


def run_batches(family, batches) -> float:
    """CPU seconds to denoise each batch (a list of (params, cond)) to the end, one after another."""
    t = clock()
    for batch in batches:
        engine = DenoiserEngine(family, EngineConfig(max_batch_requests=8))
        for i, (p, cond) in enumerate(batch):
            engine.add(family.prepare(f"r{i}", p, cond))
        engine.run_until_done()
    return clock() - t


def run_merged(family, jobs) -> float:
    linears = dict(family.pipe.transformer.named_modules())
    t = clock()
    for p, cond in jobs:
        ((name, scale),) = p.lora
        family.lora.acquire("m", p.lora)
        adapter = family.lora.store.get(name)
        family.lora.release("m")
        for mod, m in adapter.modules.items():
            linears[mod].weight.data.add_(m.b @ m.a, alpha=scale * m.scale)
        run_batches(family, [[(p.replace(lora=()), cond)]])
        for mod, m in adapter.modules.items():
            linears[mod].weight.data.add_(m.b @ m.a, alpha=-scale * m.scale)
    return clock() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(argv)
    family = load_family(resolve_model(None, os.environ.get("TRIPTYCH_CACHE")))
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    for i, name in enumerate(ADAPTERS):
        write_random_lora(root / name, family.pipe.transformer, TARGETS, rank=args.rank, seed=i, std=0.02)
    family.enable_lora(LoraConfig(lora=tuple(f"{n}={root / n}" for n in ADAPTERS)))
    jobs = []
    for i in range(8):
        p = family.resolve(GenerationParams(prompt=f"a red circle number {i}", seed=i, steps=args.steps))
        jobs.append((p.replace(lora=((ADAPTERS[i % 4], 1.0),)), family.encode(p)))
    plain = [(p.replace(lora=()), c) for p, c in jobs]
    grouped = [[j for j in jobs if j[0].lora[0][0] == n] for n in ADAPTERS]
    modes = {
        "mixed": lambda: run_batches(family, [jobs]),
        "grouped": lambda: run_batches(family, grouped),
        "merged": lambda: run_merged(family, jobs),
        "none": lambda: run_batches(family, [plain]),
    }
    best = {m: float("inf") for m in modes}
    for r in range(args.repeats + 1):
        for m, fn in modes.items():
            s = fn()
            if r:  # round 0 warms up
                best[m] = min(best[m], s)
    load = os.getloadavg()[0]
    print(
        f"default model, 8 requests over 4 adapters (rank {args.rank}), {args.steps} steps, CFG on, "
        f"best of {args.repeats}, load average {load:.1f}"
    )
    print("| mode | CPU s (8 requests) | images/s | vs mixed |")
    print("|---|---|---|---|")
    for m, s in best.items():
        print(f"| {m} | {s:.3f} | {8 / s:.2f} | {s / best['mixed']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
