"""Score the shape world's video model from pixels on held-out clips, beside a random-weight twin.

``python -m training.evaluate_video --model DIR --out EVAL_DIR [--n 50] [--split train]``

Held-out prompts: ``clip_caption(clip, "short")`` of ``sample_clips(n, "eval", "heldout")`` (the
world's held-out (shape, colour, background) combinations, never seen in training; any direction,
either size); request seed = index; through ``load_family`` + ``run_request`` like ``triptych
generate`` (the model's ``triptych.json`` defaults). Each video is read back by
``shapeworld.video_scorer``: per frame shape kind, shape colour and background; the direction of
motion from the shape centroid's trajectory. A video counts for an attribute when it is right on at
least 80% of its frames. The random-weight twin (same architecture, tokenizer, VAE and settings;
text encoder and transformer untrained) runs on the same prompts and seeds.

``--split train`` scores ``sample_clips(n, "validation", "train")`` instead: clips of train
combinations, for choosing settings such as the guidance scale without looking at held-out prompts.

Writes ``EVAL_DIR/results.json``, ``EVAL_DIR/gallery.png`` (frame strips of the first held-out
prompts) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from shapeworld.video import clip_caption, sample_clips
from shapeworld.video_scorer import FRAME_KEYS, clip_accuracy, score_clip

logger = logging.getLogger("training.evaluate_video")
MEASURES = (*FRAME_KEYS, "frames_all", "direction", "all")
#: ``sample_clips`` seed per split: held-out prompts for the figures, train ones for choosing settings.
SAMPLE_SEEDS = {"heldout": "eval", "train": "validation"}


def generate(model_dir: Path, clips, steps: int | None = None, guidance: float | None = None):
    """``(videos, per-video scores)``: ``videos[i]`` is ``(F, H, W, 3)`` uint8, seed ``i``."""
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.registry import load_family

    family = load_family(model_dir)
    videos, rows = [], []
    for i, clip in enumerate(clips):
        params = GenerationParams(prompt=clip_caption(clip, "short"), seed=i, steps=steps, guidance=guidance)
        frames, _ = run_request(family, params)
        video = frames.to_uint8()
        videos.append(video)
        rows.append(score_clip(video, clip))
    return videos, rows


def separation(model_dir: Path) -> dict[str, float]:
    """How far apart the text encoder puts prompts that differ in one word, per kind of word:
    ``|e(a) - e(b)| / |e(a)|`` over the prompt embeddings the transformer gets (mean over 102 train
    clips, each against the clip with the next value of that field). The default image model's
    lesson: states that hardly separate shape words left the shape kind unlearnable."""
    import dataclasses

    import torch
    from diffusers import WanPipeline

    from shapeworld import COLOR_NAMES, SHAPES
    from shapeworld.video import DIRECTIONS, iter_all_clips

    pipe = WanPipeline.from_pretrained(model_dir, transformer=None, vae=None)
    length = json.loads((model_dir / "triptych.json").read_text())["max_sequence_length"]
    values = {"shape": SHAPES, "color": COLOR_NAMES, "background": COLOR_NAMES, "direction": tuple(DIRECTIONS)}
    out = {}
    for field, options in values.items():
        a, b = [], []
        for clip in iter_all_clips("train")[::16]:
            here = options.index(getattr(clip, field))
            for k in range(1, len(options)):
                try:
                    other = dataclasses.replace(clip, **{field: options[(here + k) % len(options)]})
                except ValueError:  # colour == background
                    continue
                a.append(clip_caption(clip, "short"))
                b.append(clip_caption(other, "short"))
                break
        with torch.no_grad():
            ea = pipe._get_t5_prompt_embeds(prompt=a, max_sequence_length=length, device="cpu").flatten(1)
            eb = pipe._get_t5_prompt_embeds(prompt=b, max_sequence_length=length, device="cpu").flatten(1)
        out[field] = float(((ea - eb).norm(dim=1) / ea.norm(dim=1)).mean())
    return out


def strip(path: Path, videos, labels, scale: int = 2) -> None:
    """One row per video: its frames left to right, the prompt above."""
    from PIL import Image, ImageDraw

    frames, side = videos[0].shape[0], videos[0].shape[1] * scale
    text_h, gap = 14, 2
    sheet = Image.new("RGB", (frames * (side + gap), len(videos) * (side + text_h + gap)), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (video, label) in enumerate(zip(videos, labels)):
        y = r * (side + text_h + gap)
        draw.text((2, y + 1), label, fill="black")
        for f, frame in enumerate(video):
            tile = Image.fromarray(frame).resize((side, side), Image.NEAREST)
            sheet.paste(tile, (f * (side + gap), y + text_h))
    sheet.save(path, optimize=True)


def evaluate(
    model: Path,
    out: Path,
    n: int = 50,
    seed: int = 0,
    steps: int | None = None,
    guidance: float | None = None,
    random_twin: bool = True,
    gallery_rows: int = 8,
    split: str = "heldout",
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    clips = sample_clips(n, SAMPLE_SEEDS[split], split)
    assert all(c.split == split for c in clips)
    results: dict = {"n": n, "split": split, "prompts": [clip_caption(c, "short") for c in clips]}
    t = time.time()
    videos, rows = generate(model, clips, steps, guidance)
    results["seconds"] = time.time() - t
    results["trained"], results["per_video"] = clip_accuracy(rows), rows
    strip(out / "gallery.png", videos[:gallery_rows], results["prompts"][:gallery_rows])
    np.save(out / "videos.npy", np.stack(videos))
    results["separation"] = separation(model)
    logger.info("trained %s; text separation %s", results["trained"], results["separation"])
    if random_twin:
        from training.video_model import random_model

        defaults = json.loads((model / "triptych.json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            random_model(Path(tmp) / "random", seed, defaults, like=model)
            rvideos, rrows = generate(Path(tmp) / "random", clips, steps, guidance)
            results["separation_random"] = separation(Path(tmp) / "random")
        results["random"], results["per_video_random"] = clip_accuracy(rrows), rrows
        strip(out / "gallery_random.png", rvideos[:4], results["prompts"][:4])
        logger.info("random %s", results["random"])
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def table(r: dict) -> str:
    names = {
        "shape": "shape kind right on >= 80% of frames",
        "color": "shape colour right on >= 80% of frames",
        "background": "background right on >= 80% of frames",
        "frames_all": "all three right on >= 80% of frames",
        "direction": "direction of motion right",
        "all": "all three on >= 80% of frames and direction",
    }
    rnd = r.get("random", {})
    split = {"heldout": "held-out", "train": "train-combination"}[r.get("split", "heldout")]
    lines = [f"| {split} videos ({r['n']}) | trained | random weights |", "|---|---|---|"]
    for k in MEASURES:
        lines.append(
            f"| {names[k]} | {r['trained'][k]:.0%} | {rnd[k]:.0%} |"
            if rnd
            else f"| {names[k]} | {r['trained'][k]:.0%} | |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m training.evaluate_video", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="WanPipeline directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="seed of the random-weight twin")
    p.add_argument("--steps", type=int)
    p.add_argument("--guidance", type=float)
    p.add_argument("--no-random", action="store_true", help="skip the random-weight twin")
    p.add_argument("--split", choices=sorted(SAMPLE_SEEDS), default="heldout", help="train: for choosing settings")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    torch.set_num_threads(1)
    results = evaluate(
        args.model, args.out, args.n, args.seed, args.steps, args.guidance, not args.no_random, split=args.split
    )
    logger.info("results\n%s", table(results))
    return results


if __name__ == "__main__":
    main()
