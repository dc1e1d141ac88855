"""What a LoRA adapter does to TeaCache's decisions on the default model (docs/lora.md).

TeaCache's profile is fitted on the base model; an adapter changes the blocks' outputs and hence the
trajectory whose input changes TeaCache accumulates. For each shipped adapter (and none) and each
threshold, on held-out prompts: the share of transformer rows skipped, the PSNR of the cached image
against the same request uncached (same adapter), and whether the scorer still reads the adapter's
effect and the prompt's attributes.

    python benchmarks/lora_teacache.py [--n 8] [--thresholds 0.05 0.1 0.2 0.4]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from shapeworld import caption, read_scene, sample_scenes  # noqa: E402
from shapeworld.styles import STYLES, effect_present, style_scene  # noqa: E402
from triptych.calibration.metrics import psnr  # noqa: E402
from triptych.engine import DenoiserEngine, EngineConfig  # noqa: E402
from triptych.engine.teacache import make_teacache  # noqa: E402
from triptych.families.base import GenerationParams  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402
from triptych.lora.config import LoraConfig  # noqa: E402

MODEL = os.path.join(os.path.dirname(__file__), "..", "triptych", "assets", "default")
ADHERENCE = ("shape", "color", "background")


def image(family, prompt: str, seed: int, threshold: float, style: str | None) -> tuple[np.ndarray, float]:
    """(uint8 image, share of rows skipped) for one request through the engine."""
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True), accel=make_teacache(family))
    p = family.resolve(GenerationParams(prompt=prompt, seed=seed, teacache_threshold=threshold))
    state = family.prepare("r", p.replace(lora=((style, 1.0),) if style else ()), family.encode(p))
    engine.add(state)
    with torch.no_grad():
        while engine.has_work():
            engine.step()
    frames = family.decode(state.latents, state.params)
    skipped = engine.stats.skipped_rows / max(1, engine.stats.rows)
    return (np.clip(frames.array[0], 0, 1) * 255).round().astype(np.uint8), skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    args = ap.parse_args()
    torch.set_num_threads(1)
    family = load_family(MODEL)
    lora = tuple(f"{s}={MODEL}/lora/{s}" for s in STYLES)
    family.enable_lora(LoraConfig(lora=lora))
    scenes = sample_scenes(args.n, "lora-eval", "heldout")
    print("| adapter | threshold | rows skipped | PSNR vs uncached (min / mean dB) | effect | adherence |")
    print("|---|---|---|---|---|---|")
    for style in (None, *STYLES):
        plain = [image(family, caption(s, "long"), i, 0.0, style)[0] for i, s in enumerate(scenes)]
        for threshold in args.thresholds:
            rows = [image(family, caption(s, "long"), i, threshold, style) for i, s in enumerate(scenes)]
            db = [psnr(a.astype(np.float32) / 255, b.astype(np.float32) / 255) for (a, _), b in zip(rows, plain)]
            reads = [read_scene(a) for a, _ in rows]
            effect = np.mean([effect_present(r, s, style) for r, s in zip(reads, scenes)]) if style else 0.0
            adhere = np.mean(
                [
                    all(getattr(r, k) == getattr(style_scene(s, style), k) for k in ADHERENCE)
                    for r, s in zip(reads, scenes)
                ]
            )
            skipped = np.mean([k for _, k in rows])
            print(
                f"| {style or 'none'} | {threshold} | {skipped:.0%} | {min(db):.1f} / {np.mean(db):.1f} "
                f"| {effect:.0%} | {adhere:.0%} |"
            )


if __name__ == "__main__":
    main()
