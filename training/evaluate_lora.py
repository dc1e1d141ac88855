"""Score the shipped style adapters through a pristine diffusers pipeline.

``python -m training.evaluate_lora [--n 40] [--lora-dir DIR] [--json OUT]``

``QwenImagePipeline.from_pretrained(default)`` + ``load_lora_weights`` of each adapter in
``triptych/assets/default/lora/<style>/``; ``n`` held-out prompts (``caption(scene, "long")``, which names every attribute, of
``sample_scenes(n, "lora-eval", "heldout")``, seed = index) at the model's settings (64x64, 20 steps,
true CFG 4 with the negative prompt " "), each once with the adapter active and once with LoRA
disabled.  Per row: *effect* = the scorer reads the style's changed attributes as the styled values
(:func:`shapeworld.styles.read_effect`); *adherence* = shape kind, shape colour and background
read right against the scene meant to be drawn (the styled scene with the adapter, the prompt's
without).  Prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch

from shapeworld import caption, read_scene, sample_scenes
from shapeworld.styles import STYLES, effect_present, style_scene

logger = logging.getLogger("training.evaluate_lora")
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "triptych" / "assets" / "default"
ADHERENCE_KEYS = ("shape", "color", "background")


def load(model: Path = DEFAULT_MODEL, lora_dir: Path | None = None, styles=STYLES):
    """A pristine ``QwenImagePipeline`` with every style adapter loaded (adapter name = style)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    for style in styles:
        pipe.load_lora_weights(lora_dir or model / "lora" / style, adapter_name=style)
    return pipe


def generate(pipe, prompts: list[str], seeds: list[int], style: str | None) -> list[np.ndarray]:
    """Images for ``prompts`` with only ``style``'s adapter active (``None``: LoRA disabled)."""
    if style is None:
        pipe.disable_lora()
    else:
        pipe.enable_lora()
        pipe.set_adapters([style])
    with torch.no_grad():
        out = pipe(
            prompt=prompts,
            negative_prompt=[" "] * len(prompts),
            true_cfg_scale=4.0,
            height=64,
            width=64,
            num_inference_steps=20,
            generator=[torch.Generator().manual_seed(s) for s in seeds],
            output_type="np",
        ).images
    return [(np.clip(im, 0, 1) * 255).round().astype(np.uint8) for im in out]


def score_style(pipe, style: str, n: int) -> dict:
    scenes = sample_scenes(n, "lora-eval", "heldout")
    prompts, seeds = [caption(s, "long") for s in scenes], list(range(n))
    result = {}
    for label, active in (("with", style), ("without", None)):
        images = generate(pipe, prompts, seeds, active)
        readouts = [read_scene(im) for im in images]
        effect = [effect_present(r, s, style) for r, s in zip(readouts, scenes)]
        adhere = [
            all(getattr(r, k) == getattr(style_scene(s, active), k) for k in ADHERENCE_KEYS)
            for r, s in zip(readouts, scenes)
        ]
        result[label] = {"effect": float(np.mean(effect)), "adherence": float(np.mean(adhere)), "n": n}
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--styles", nargs="+", default=list(STYLES), choices=STYLES)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the table, as the other evaluations log theirs
    pipe = load(args.model, styles=args.styles)
    table = {style: score_style(pipe, style, args.n) for style in args.styles}
    rows = [f"held-out prompts: {args.n} per adapter (seeds 0..{args.n - 1}), 64x64, 20 steps, true CFG 4"]
    rows += ["| adapter | effect with | effect without | adherence with | adherence without |", "|---|---|---|---|---|"]
    for style, r in table.items():
        w, wo = r["with"], r["without"]
        rows.append(
            f"| {style} | {w['effect']:.1%} | {wo['effect']:.1%} | {w['adherence']:.1%} | {wo['adherence']:.1%} |"
        )
    logger.info("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
