"""Train the shape world's tiny Wan 2.1 text-to-video model (text encoder and transformer jointly).

``python -m training.train_video --out runs/video --seed 0 [--phase P] [--init DIR] [--steps N]
[--stop S] [--resume]``

Data: every train clip (203 train (shape, colour, background) combinations x 4 directions x 2 sizes
= 1,624 clips of 9 frames at 64 px). Their VAE latents are computed once, frame by frame with the
image VAE (the video VAE codes each frame exactly like it), normalised with ``latents_mean/std`` as
WanPipeline denormalises, and cached in ``OUT/video_data.pt``.

Objective: rectified flow as UniPC with flow sigmas integrates it: ``x_s = (1 - s) x0 + s e``, the
transformer gets ``timestep = 1000 s`` (WanPipeline passes ``scheduler.timesteps``, ``1000 sigma``)
and predicts ``e - x0``. The prompt embeddings are WanPipeline's own ``_get_t5_prompt_embeds`` of the
batch's captions (short/long/tag), with gradients into the text encoder, zero-padded to
``MAX_SEQUENCE_LENGTH``; 10% are the negative prompt ``""`` (CFG). The latent pixels under the shape
are weighted ``fg`` times in the loss (the default image model's lesson: the shape kind is a few
tokens' detail). With ``identity`` > 0 the text encoder also learns to name every caption's shape,
colour, background and direction from its pooled embeddings (``video_objective.IdentityHead``,
training only). ``--init DIR`` starts phase 1 from a trained video model's text encoder and
transformer (``video_model.warm_start``). EMA weights of both are exported.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
from pathlib import Path

import numpy as np
import torch

from shapeworld.video import CLIP_CAPTION_STYLES, CLIP_FRAMES, Clip, clip_caption, iter_all_clips
from training.common import (
    Timer,
    cosine_lr,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    setup,
    single_frame_convs,
)
from training.data import contrast
from training.dit_objective import _ema
from training.video_model import (
    DIMS,
    IMAGE_VAE,
    MAX_SEQUENCE_LENGTH,
    components,
    pipeline,
    warm_start,
    write_model,
)
from training.video_objective import IdentityHead, flow_loss, identity_labels
from training.video_shape_probe import ShapeProbe, shape_loss, train_probe

logger = logging.getLogger("training.video")
STYLE_P = (0.4, 0.4, 0.2)
NEGATIVE = ""  # WanPipeline's default negative prompt
CFG_DROP = 0.1
#: Phases (each from the previous one's weights with a fresh optimiser); see the model card.
#: 1: AdamW lr 1e-3 on a cosine schedule, a third of the noise levels from [0.8, 1] (the image model
#: took the background from the noisy latents until it trained there), shape pixels weighted 4x.
#: 2: from phase 1's EMA weights on a fresh cosine schedule, half the noise levels from [0.8, 1]:
#: after phase 1 (3,600 steps) colour and background were right on every held-out video, but the
#: shape was a blob that changed from frame to frame, with no motion. On 8 train clips its one-step
#: x0 prediction had the direction right on 8/8 from sigma 0.6, 7/8 from 0.8, 0/8 from 0.95: the
#: motion came from the noisy latents, not the prompt, and sampling starts at sigma 1.
#: 3: the same from phase 2's EMA weights with two thirds of the noise levels from [0.8, 1]: after
#: phase 2 still 0/50 held-out videos moved the right way (one steady blob), after phase 3 6/50.
#: Those three phases made the model shipped before the captions named the direction by its own word.
#: 4: from that model (``--init``; its tokenizer differs, see ``video_model.warm_start``) with the
#: new captions, the identity loss on the text encoder, half the noise levels from [0.8, 1] and the
#: shape pixels weighted 6x (that model drew the right colours but the shape kind on 1/50 held-out
#: videos and the direction on 6/50; its text encoder did not separate shape words).
#: 5: from phase 4's EMA weights, lr 5e-4, a third of the noise levels from [0.8, 1] and the shape
#: pixels 8x: after 3,000 of phase 4's 10,000 steps the direction was right on 16/16 held-out videos
#: but the shape kind on 3/16 (2/16 of train combinations): the shape is drawn at middle noise levels.
#: 6: phase 5 again from its EMA weights (on 32 clips of train combinations the shape kind went 62%
#: after phase 4 -> 72% after phase 5, still rising).
#: 7: from the phase 6 model (``--init``), a lower lr and a quarter of the noise levels from [0.8, 1]:
#: annealing, with more of the steps at the middle noise levels where the outline is decided.
#: 8: from phase 7's weights (``--init``) at half its lr, each clip's loss weighted by the inverse of
#: its colour contrast (mean weight 1, ``balance``): on 32 clips of train combinations, with the
#: fine-tuned VAE decoder, the shape kind went 78% with phase 6's weights -> 88% with phase 7's, but
#: most misses left were outlines between colours that differ in one RGB channel (red on magenta, cyan
#: on white), whose errors cost the loss a third of what a high-contrast outline's do.
#: 9: phase 8 plus the shape probe's loss (``video_shape_probe``, weight 0.1), run beside phase 8 from
#: the same phase 7 weights: the misses are blobs between a circle and a square.
#: 10: phase 9 with the shape loss weighted 0.3, also from phase 7's weights.
#: 11: phase 9 again from its weights (``--init``) at half its lr (phase 9: 92% of 100 clips of train
#: combinations; phase 10: 85%).
#: 12: phase 9 again from its weights (``--init``) at its own lr: a longer phase 9 (phase 9's held-out
#: shape kind went 74% at 2,000 steps -> 78% at 4,500). 87% of 100 train clips: not shipped.
#: 13: phase 9 (from phase 7's weights) with the shape loss only where ``s`` <= 0.7. The idea: at
#: higher noise the position is not yet decided and the x0 prediction is a mean over positions, a blur
#: the probe should not be asked to name. 91% of 300 train clips against phase 9's 93% (both with the
#: Euler sampler): not shipped.
#: 14: phase 13 with the shape loss weighted 0.2 (it applies to about two thirds of the clips); stopped
#: at 500 steps to free the CPU.
PHASES = {
    1: {"lr": 1e-3, "high": 1 / 3, "fg": 4.0, "identity": 0.0},
    2: {"lr": 1e-3, "high": 1 / 2, "fg": 4.0, "identity": 0.0},
    3: {"lr": 1e-3, "high": 2 / 3, "fg": 4.0, "identity": 0.0},
    4: {"lr": 1e-3, "high": 1 / 2, "fg": 6.0, "identity": 1.0},
    5: {"lr": 5e-4, "high": 1 / 3, "fg": 8.0, "identity": 1.0},
    6: {"lr": 5e-4, "high": 1 / 3, "fg": 8.0, "identity": 1.0},
    7: {"lr": 3e-4, "high": 1 / 4, "fg": 8.0, "identity": 1.0},
    8: {"lr": 1.5e-4, "high": 1 / 4, "fg": 8.0, "identity": 1.0, "balance": True},
    9: {"lr": 1.5e-4, "high": 1 / 4, "fg": 8.0, "identity": 1.0, "balance": True, "shape": 0.1},
    10: {"lr": 1.5e-4, "high": 1 / 4, "fg": 8.0, "identity": 1.0, "balance": True, "shape": 0.3},
    11: {"lr": 7.5e-5, "high": 1 / 4, "fg": 8.0, "identity": 1.0, "balance": True, "shape": 0.1},
    12: {"lr": 1.5e-4, "high": 1 / 4, "fg": 8.0, "identity": 1.0, "balance": True, "shape": 0.1},
    13: {"lr": 1.5e-4, "high": 1 / 4, "fg": 8.0, "identity": 1.0, "balance": True, "shape": 0.1, "shape_below": 0.7},
    14: {"lr": 1.5e-4, "high": 1 / 4, "fg": 8.0, "identity": 1.0, "balance": True, "shape": 0.2, "shape_below": 0.7},
}
#: Reversed directions: a leftwards clip is a rightwards one played backwards (frames shared).
REVERSED = {"leftwards": "rightwards", "upwards": "downwards"}


def clip_pixels(clips: list[Clip], frames: int = CLIP_FRAMES) -> torch.Tensor:
    """``(N, 3, F, H, W)`` in [-1, 1]; ``frames=1``: each clip's first frame only."""
    from shapeworld.video import render_clip

    arr = np.stack([render_clip(c, frames) for c in clips]).astype(np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(0, 4, 1, 2, 3).contiguous()  # (N, 3, F, H, W)


@torch.no_grad()
def precompute(out: Path) -> dict:
    """Normalised latents ``(N, 16, F, 8, 8)`` of every train clip and the loss's shape masks."""
    path = out / "video_data.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    from diffusers import AutoencoderKLQwenImage

    timer = Timer()
    vae = AutoencoderKLQwenImage.from_pretrained(IMAGE_VAE).eval()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    clips = list(iter_all_clips("train"))
    forward = [c for c in clips if c.direction not in REVERSED]
    lat, fg = {}, {}
    for i in range(0, len(forward), 8):
        chunk = forward[i : i + 8]
        pix = clip_pixels(chunk)
        frames = pix.transpose(1, 2).flatten(0, 1).unsqueeze(2)  # (N*F, 3, 1, H, W)
        with single_frame_convs():
            z = vae.encode(frames).latent_dist.mode()
        z = z.view(len(chunk), CLIP_FRAMES, *z.shape[1:]).squeeze(3).transpose(1, 2)  # (n, C, F, h, w)
        mask = ((pix - pix[..., :1, :1]).abs().sum(1) > 0.05).float()  # (n, F, H, W)
        token = torch.nn.functional.max_pool2d(mask, 16)  # a 2x2-latent token = 16x16 px
        pixel = token.repeat_interleave(2, -1).repeat_interleave(2, -2).unsqueeze(1)  # (n, 1, F, 8, 8)
        for c, zc, mc in zip(chunk, (z - mean) / std, pixel):
            lat[c], fg[c] = zc, mc
        if i % 160 == 0:
            logger.info("video: latents %d/%d (%.0fs)", i, len(forward), timer())
    for c in clips:
        if c.direction in REVERSED:
            src = Clip(c.shape, c.color, c.background, REVERSED[c.direction], c.size)
            lat[c], fg[c] = lat[src].flip(1), fg[src].flip(1)
    result = dict(
        clips=clips,
        x0=torch.stack([lat[c] for c in clips]),
        fg=torch.stack([fg[c] for c in clips]),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, path)
    logger.info("video: %d clips, latents %s (%.0fs)", len(clips), tuple(result["x0"].shape), timer())
    return result


class Trainable(torch.nn.Module):
    """The text encoder and transformer as one module (one optimiser, one EMA, one state dict), with
    the identity head (training only: never exported)."""

    def __init__(self, text_encoder, transformer):
        super().__init__()
        self.text_encoder, self.transformer = text_encoder, transformer
        self.identity = IdentityHead(DIMS["text_dim"])


def step_loss(pipe, model, d, idx, styles, weight, gen, cfg, probe=None) -> tuple[torch.Tensor, ...]:
    """Flow loss of the batch ``idx`` (``styles[i]``: a caption style, or ``None`` for the negative
    prompt), the identity loss of its captions and the shape probe's loss on their x0 predictions."""
    prompts = [NEGATIVE if s is None else clip_caption(d["clips"][i], s) for i, s in zip(idx, styles)]
    embeds = pipe._get_t5_prompt_embeds(prompt=prompts, max_sequence_length=MAX_SEQUENCE_LENGTH, device="cpu")
    flow, x0_pred, sigma = flow_loss(pipe.transformer, d["x0"][idx], embeds, weight[idx], gen, cfg["high"])
    named = [k for k, s in enumerate(styles) if s is not None]
    zero = torch.zeros(())
    if not named:
        return flow, zero, zero
    clips = [d["clips"][idx[k]] for k in named]
    ident = model.identity(embeds[named], identity_labels(clips)) if cfg["identity"] else zero
    keep = sigma[named] <= cfg["shape_below"] if "shape_below" in cfg else None
    shape = shape_loss(probe, x0_pred[named], [c.shape for c in clips], keep) if probe is not None else zero
    return flow, ident, shape


def train_video(
    out: Path,
    seed: int,
    steps: int,
    stop: int | None = None,
    batch: int = 16,
    phase: int = 1,
    resume: bool = False,
    log_every: int = 50,
    ckpt_every: int = 200,
    export_every: int = 1000,
    init: Path | None = None,
) -> Path:
    """Train phase ``phase`` on a ``steps``-long cosine schedule (ending at ``stop`` if given); the EMA
    weights are written as a WanPipeline directory ``OUT/model`` every ``export_every`` steps and at
    the end."""
    cfg = PHASES[phase]
    d = precompute(out)
    parts = components(seed)
    if init is not None:
        logger.info("video: warm start from %s (%d token rows copied)", init, warm_start(parts, init))
    model = Trainable(parts["text_encoder"], parts["transformer"])
    if phase > 1 and init is None:
        model.load_state_dict(torch.load(_ckpt(out, phase - 1), weights_only=False)["ema"])
    ema = copy.deepcopy(model).requires_grad_(False)
    pipe = pipeline(parts)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed + 100 * (phase - 1))
    rng = random.Random(f"{seed}|video|{phase}")
    start = 0
    state = load_checkpoint(_ckpt(out, phase)) if resume else None
    if state:
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        set_rng_state(state["rng"])
        gen.set_state(state["gen"])
        rng.setstate(state["pyrng"])
        start = state["step"]
        logger.info("video: resumed at step %d", start)
    probe = shape_probe(out, d, seed) if cfg.get("shape") else None
    weight = 1.0 + (cfg["fg"] - 1.0) * d["fg"]
    if cfg.get("balance"):
        inverse = 1 / contrast(clip_pixels(d["clips"], frames=1)).clamp(min=1e-3)
        weight = weight * (inverse / inverse.mean()).view(-1, 1, 1, 1, 1)
    n = d["x0"].shape[0]
    timer = Timer()
    model.train()
    end = stop or steps
    for step in range(start, end):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, cfg["lr"], warmup=100)
        idx = [rng.randrange(n) for _ in range(batch)]
        styles = [None if rng.random() < CFG_DROP else rng.choices(CLIP_CAPTION_STYLES, STYLE_P)[0] for _ in idx]
        opt.zero_grad(set_to_none=True)
        flow, ident, shape = step_loss(pipe, model, d, idx, styles, weight, gen, cfg, probe)
        (flow + cfg["identity"] * ident + cfg.get("shape", 0.0) * shape).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _ema(ema, model, step)
        if step % log_every == 0 or step == end - 1:
            logger.info(
                "video step %d/%d loss %.4f identity %.4f shape %.4f (%.0fs)",
                *(step, end, flow.item(), ident.item(), shape.item(), timer()),
            )
        done = step + 1
        if done % ckpt_every == 0 or done == end:
            save_checkpoint(
                _ckpt(out, phase),
                model=model.state_dict(),
                ema=ema.state_dict(),
                opt=opt.state_dict(),
                step=done,
                rng=rng_state(),
                gen=gen.get_state(),
                pyrng=rng.getstate(),
            )
        if done % export_every == 0 or done == end:
            export(out, ema, parts, step=done)
    return out / "model"


def shape_probe(out: Path, d: dict, seed: int):
    """The frozen shape probe (``video_shape_probe``), fitted once per run and cached in ``OUT``."""
    path = out / "shape_probe.pt"
    probe = ShapeProbe(d["x0"].shape[1])
    if path.is_file():
        probe.load_state_dict(torch.load(path))
        return probe.eval().requires_grad_(False)
    probe = train_probe(d["x0"], [c.shape for c in d["clips"]], seed)
    torch.save(probe.state_dict(), path)
    return probe


def export(out: Path, ema: Trainable, parts: dict, step: int) -> Path:
    """The EMA weights as ``OUT/model`` (a WanPipeline directory)."""
    model = write_model(
        {**parts, "text_encoder": ema.text_encoder.eval(), "transformer": ema.transformer.eval()}, out / "model"
    )
    (out / "model_step.json").write_text(json.dumps({"step": step}) + "\n")
    logger.info("video: exported step %d to %s", step, model)
    return model


def _ckpt(out: Path, phase: int) -> Path:
    return out / f"video{phase}.ckpt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.train_video", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=12000, help="cosine schedule length")
    p.add_argument("--stop", type=int, help="stop at this step of the schedule")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--phase", type=int, default=1, choices=sorted(PHASES))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init", type=Path, help="warm start from this trained video model directory")
    p.add_argument("--export-every", type=int, default=1000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup(args.seed)
    timer = Timer()
    model = train_video(
        args.out,
        args.seed,
        args.steps,
        args.stop,
        args.batch,
        args.phase,
        args.resume,
        export_every=args.export_every,
        init=args.init,
    )
    record(args.out, model, vars(args), timer())
    return 0


def record(out: Path, model: Path, args: dict, seconds: float) -> None:
    """``OUT/training.json``: the command's settings, wall time and the exported weights' hashes."""
    from training.common import tree_sha256

    settings = {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}
    data = {"settings": settings, "wall_seconds": round(seconds), "phases": PHASES, "sha256": tree_sha256(model)}
    (out / "training.json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
