"""Score a trained default model with the world's pixel scorer, beside a random-weight twin.

``python -m training.evaluate --model DIR --edit-model DIR --out EVAL_DIR``

- text-to-image: 50 held-out prompts (``caption(scene, "short")`` of ``sample_scenes(50, "eval",
  "heldout")``; request seed = index), through ``load_family`` + ``run_request`` like ``triptych
  generate``; an image counts when shape kind, shape colour and background colour all read back right.
  The random-weight model (same architecture, tokenizer and settings, untrained) runs alongside.
- edit: 50 held-out edit pairs (``sample_edit_pairs(50, "eval", "heldout")``), the source rendered at
  64 px as the condition image; a pair counts when every attribute of the target reads back (the
  edited one changed, the other four kept).
- captioner: the text encoder asked "What is in this image?" through its chat template on 50
  held-out images (greedy); counts when the answer names the shape and its colour.

Writes ``EVAL_DIR/results.json``, ``EVAL_DIR/gallery.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from shapeworld import caption, render, sample_edit_pairs, sample_scenes, score, score_caption

logger = logging.getLogger("training.evaluate")
T2I_KEYS = ("shape", "color", "background")


def _rate(rows: list[dict[str, bool]], keys) -> dict[str, float]:
    out = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    out["all"] = float(np.mean([all(r[k] for k in keys) for r in rows]))
    return out


def t2i(model_dir: Path, n: int = 50, steps: int | None = None, guidance: float | None = None):
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.registry import load_family

    family = load_family(model_dir)
    scenes = sample_scenes(n, "eval", "heldout")
    rows, images = [], []
    for i, s in enumerate(scenes):
        params = GenerationParams(prompt=caption(s, "short"), seed=i, steps=steps, guidance=guidance)
        frames, _ = run_request(family, params)
        img = frames.to_uint8()[0]
        images.append(img)
        rows.append(score(img, s))
    return _rate(rows, T2I_KEYS), images, scenes


def edit(model_dir: Path, n: int = 50, steps: int | None = None, guidance: float | None = None):
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.registry import load_family

    family = load_family(model_dir)
    pairs = sample_edit_pairs(n, "eval", "heldout")
    rows, images = [], []
    for i, p in enumerate(pairs):
        params = GenerationParams(
            prompt=p.instruction, image=render(p.source, 64), seed=i, steps=steps, guidance=guidance
        )
        frames, _ = run_request(family, params)
        img = frames.to_uint8()[0]
        images.append(img)
        r = score(img, p.target)
        rows.append({"edited": r[p.attribute], "kept": all(v for k, v in r.items() if k != p.attribute), **r})
    return _rate(rows, ("edited", "kept")), images, pairs


def captions(model_dir: Path, n: int = 50):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from training import build
    from training.train_vlm import caption_images

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir / "text_encoder").eval()
    proc = build.processor(AutoTokenizer.from_pretrained(model_dir / "tokenizer"))
    scenes = sample_scenes(n, "eval-captions", "heldout")
    answers = caption_images(model, proc, [render(s, 64) for s in scenes])
    rows = [score_caption(a, s) for a, s in zip(answers, scenes)]
    return _rate(rows, ("shape", "color")), answers, scenes


def gallery(path: Path, images, labels, cols: int = 8, scale: int = 2) -> None:
    from PIL import Image, ImageDraw

    cell, text_h = 64 * scale, 28
    rows = (len(images) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (img, label) in enumerate(zip(images, labels)):
        x, y = (i % cols) * cell, (i // cols) * (cell + text_h)
        sheet.paste(Image.fromarray(img).resize((cell, cell), Image.NEAREST), (x, y))
        words = label.split()
        half = (len(words) + 1) // 2
        draw.text((x + 2, y + cell + 1), " ".join(words[:half]), fill="black")
        draw.text((x + 2, y + cell + 13), " ".join(words[half:]), fill="black")
    sheet.save(path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m training.evaluate")
    p.add_argument("--model", type=Path, required=True, help="QwenImagePipeline directory (text-to-image)")
    p.add_argument("--edit-model", type=Path, help="QwenImageEditPipeline directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="seed of the random-weight baseline")
    p.add_argument("--steps", type=int)
    p.add_argument("--guidance", type=float)
    p.add_argument("--skip", nargs="*", default=(), choices=("random", "edit", "captions"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"n": args.n}
    t = time.time()
    results["t2i"], images, scenes = t2i(args.model, args.n, args.steps, args.guidance)
    results["t2i_seconds"] = time.time() - t
    gallery(args.out / "gallery.png", images[:32], [caption(s, "short") for s in scenes[:32]])
    logger.info("t2i %s", results["t2i"])
    if "random" not in args.skip:
        from training.assemble import random_model

        defaults = json.loads((args.model / "triptych.json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            random_model(Path(tmp) / "random", args.seed, False, defaults)
            results["t2i_random"], rimages, _ = t2i(Path(tmp) / "random", args.n, args.steps, args.guidance)
        logger.info("t2i random %s", results["t2i_random"])
    if "captions" not in args.skip:
        results["captions"], answers, cscenes = captions(args.model, args.n)
        results["caption_examples"] = [[caption(s, "long"), a] for s, a in list(zip(cscenes, answers))[:8]]
        logger.info("captions %s", results["captions"])
    if args.edit_model and "edit" not in args.skip:
        t = time.time()
        results["edit"], eimages, pairs = edit(args.edit_model, args.n, args.steps, args.guidance)
        results["edit_seconds"] = time.time() - t
        srcs = [np.asarray(render(pp.source, 64)) for pp in pairs[:16]]
        mixed = [im for pair in zip(srcs, eimages[:16]) for im in pair]
        labels = [lab for pp in pairs[:16] for lab in ("source", pp.instruction)]
        gallery(args.out / "gallery_edit.png", mixed, labels)
        logger.info("edit %s", results["edit"])
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    logger.info("results\n%s", table(results))
    return results


def table(r: dict) -> str:
    lines = ["| task | measure | trained | random weights |", "|---|---|---|---|"]
    rnd = r.get("t2i_random", {})
    n = r["n"]
    for k in (*T2I_KEYS, "all"):
        lines.append(
            f"| text→image ({n} held-out prompts) | {k} | {r['t2i'][k]:.0%} | {rnd.get(k, float('nan')):.0%} |"
        )
    if "edit" in r:
        for k in ("edited", "kept", "all"):
            lines.append(f"| edit ({n} held-out pairs) | {k} | {r['edit'][k]:.0%} | |")
    if "captions" in r:
        for k in ("shape", "color", "all"):
            lines.append(f"| captioner ({n} held-out images) | {k} | {r['captions'][k]:.0%} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
