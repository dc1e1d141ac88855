"""What previews (``partial_images``) cost: one request in one process (``run_request``) with 0 and
3 previews, against its own denoising step. A preview is one VAE decode of the predicted clean
latents plus one media encode, the same work as the final decode; the denoiser's extra work is one
subtraction per preview. Prints a table; every figure is a median of ``--repeats`` runs.

    python benchmarks/preview_cost.py [--model DIR] [--steps 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triptych.core.media import encode_frames  # noqa: E402
from triptych.engine.runner import run_request  # noqa: E402
from triptych.families.base import GenerationParams  # noqa: E402
from triptych.families.models import resolve_model  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the built-in model)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    family = load_family(resolve_model(args.model))
    params = family.resolve(GenerationParams("a red circle on a blue background", steps=args.steps, seed=1))
    rows = {0: [], 3: []}
    preview_s: list[float] = []
    for _ in range(args.repeats):
        for count in (0, 3):
            stamps: list[float] = []

            def on_preview(index, frames, stamps=stamps):
                t = time.perf_counter()
                encode_frames(frames.to_uint8(), "png")
                stamps.append(time.perf_counter() - t)

            _, timings = run_request(family, params, previews=count, on_preview=on_preview if count else None)
            rows[count].append(timings.seconds)
            preview_s += stamps
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in rows.items()}
    step = med[0]["denoise"] / args.steps
    extra = (med[3]["denoise"] - med[0]["denoise"]) / 3
    print(f"{family.name} {params.width}x{params.height}, {args.steps} steps, median of {args.repeats}")
    print("| what | ms |\n|---|---|")
    print(f"| one denoising step | {step * 1000:.1f} |")
    print(f"| final decode (VAE) | {med[0]['decode'] * 1000:.1f} |")
    print(f"| one preview (VAE decode + PNG), in the denoise time with 3 previews | {extra * 1000:.1f} |")
    print(f"| of which PNG encode | {statistics.median(preview_s) * 1000:.2f} |")
    print(
        f"| whole request, 0 previews / 3 previews | {sum(med[0].values()) * 1000:.0f} / {sum(med[3].values()) * 1000:.0f} |"
    )


if __name__ == "__main__":
    main()
