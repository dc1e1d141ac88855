"""Fine-tune the video model's VAE decoder on the frames of moving-shape clips (encoder frozen).

``python -m training.train_video_vae --out runs/video_vae --seed 0 [--steps N] [--resume] [--init VAE]
[--balance] [--samples MODEL] [--into MODEL]``

Why: the video model starts from the default image model's VAE, which was trained on still scenes
whose shapes sit at a few anchor positions. A clip's shape moves continuously (0.3 -> 0.7 of the
side), so most of its frames put a small shape off that grid, and there the image VAE's decoder
blurs it: on the 50 held-out evaluation clips, rendered and passed through encode -> decode, the
world's scorer read the shape kind right on >= 80% of the frames of only 66% of the videos (every
miss a small shape), which caps the video model below the issue's 80% whatever the transformer does.

What: the encoder (and ``latents_mean/std``) stays exactly the image VAE's, so the latent space the
transformer is trained on does not move; the decoder and ``post_quant_conv`` are trained on the
frozen encoder's latents (plus a little noise: sampled latents are never exact) of every frame of
every **train** clip (held-out combinations are never seen), with the image VAE's decoder-only loss
(``train_vae.reconstruction_loss`` with its sharpness terms, shape pixels weighted 5x). Writes
``OUT/vae`` (an ``AutoencoderKLQwenImage`` directory that ``video_model.video_vae`` turns into the
video VAE) and ``OUT/vae_training.json`` (settings, wall time, the reconstruction ceiling before and
after on held-out and train clips). ``--samples MODEL``: half of every batch decodes, instead of the
encoder's latents, the video model's own redrawings of the same frames (``video_vae_samples``), so the
decoder learns to draw the clip from what the transformer draws for it. ``--into MODEL`` then writes
it as ``MODEL/vae`` of a video model directory (``video_model.video_vae``: frame by frame in
``AutoencoderKLWan``); with ``OUT/vae`` already there, only that.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

import torch

from shapeworld.video import iter_all_clips, sample_clips
from training.common import (
    Timer,
    cosine_lr,
    resume_from,
    rng_state,
    save_checkpoint,
    setup,
    single_frame_convs,
    tree_sha256,
)
from training.data import contrast
from training.train_vae import decode_unclamped, decoder_only, reconstruction_loss
from training.train_video import clip_pixels
from training.video_model import IMAGE_VAE

logger = logging.getLogger("training.video_vae")
FG_WEIGHT = 5.0
NOISE_STD = 0.1


def clip_frames(clips) -> torch.Tensor:
    """``(N * F, 3, 1, H, W)`` in [-1, 1]: every frame of ``clips``, the VAE's single-frame layout."""
    return clip_pixels(clips).transpose(1, 2).flatten(0, 1).unsqueeze(2).contiguous()


@torch.no_grad()
def encode(vae, frames: torch.Tensor, batch: int = 128) -> torch.Tensor:
    with single_frame_convs():
        return torch.cat([vae.encode(frames[i : i + batch]).latent_dist.mode() for i in range(0, len(frames), batch)])


@torch.no_grad()
def ceiling(vae, n: int = 50) -> dict[str, float]:
    """Share of videos whose shape kind the scorer reads right on >= 80% of frames after encode ->
    decode, for the evaluation's held-out clips and for as many clips of train combinations."""
    from shapeworld.video_scorer import clip_accuracy, score_clip
    from training.evaluate_video import SAMPLE_SEEDS

    out = {}
    for split, seed in SAMPLE_SEEDS.items():
        clips = sample_clips(n, seed, split)
        rows = []
        for clip in clips:
            with single_frame_convs():
                y = vae.decode(encode(vae, clip_frames([clip]))).sample
            video = ((y[:, :, 0].permute(0, 2, 3, 1).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
            rows.append(score_clip(video, clip))
        out[split] = clip_accuracy(rows)["shape"]
    return out


def balanced_loss(y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``reconstruction_loss`` per frame, frame ``i`` weighted ``scale[i]`` (mean over the batch)."""
    per = torch.stack([reconstruction_loss(y[i : i + 1], x[i : i + 1], FG_WEIGHT, sharp=True) for i in range(len(x))])
    return (per * scale).mean()


def train_video_vae(
    out: Path,
    seed: int,
    steps: int,
    batch: int = 16,
    lr: float = 2e-4,
    resume: bool = False,
    log_every: int = 50,
    init: Path = IMAGE_VAE,
    balance: bool = False,
    samples: Path | None = None,
    redraws: int = 2,
) -> dict:
    from diffusers import AutoencoderKLQwenImage

    out.mkdir(parents=True, exist_ok=True)
    timer = Timer()
    vae = AutoencoderKLQwenImage.from_pretrained(init).eval()
    image_vae = AutoencoderKLQwenImage.from_pretrained(IMAGE_VAE)
    encoder = ("encoder.", "quant_conv.")
    reference = {k: v for k, v in image_vae.state_dict().items() if k.startswith(encoder)}
    state = vae.state_dict()
    if not all(torch.equal(v, state[k]) for k, v in reference.items()):
        raise ValueError(f"--init {init}: its encoder is not the image VAE's ({IMAGE_VAE}); the latents would move")
    before = ceiling(vae)
    logger.info("video vae: shape-kind ceiling before %s (%.0fs)", before, timer())
    clips = [c for c in iter_all_clips("train") if c.direction in ("rightwards", "downwards")]  # the others replay them
    frames = clip_frames(clips)
    latents = encode(vae, frames)
    noise = NOISE_STD * latents.std(dim=(0, 2, 3, 4), keepdim=True)
    # balance: a frame's weight is the inverse of its contrast (mean weight 1), so an outline between
    # two colours that differ in one channel (red on magenta, cyan on white) pulls like one between
    # colours that differ in all three.
    inverse = 1 / contrast(frames).clamp(min=1e-3)
    scale = inverse / inverse.mean()
    logger.info("video vae: %d frames of %d train clips encoded (%.0fs)", len(frames), len(clips), timer())
    # samples: half of every batch decodes the model's own redrawn latents of the same frames instead
    drawn = redrawn(out, samples, vae, clips, latents, seed, redraws) if samples else None
    params = decoder_only(vae)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    rng = random.Random(f"{seed}|video_vae")
    gen = torch.Generator().manual_seed(seed)
    ckpt = out / "video_vae.ckpt"
    start, state = resume_from(ckpt, resume, vae, opt, rng)
    if state:
        gen.set_state(state["gen"])
    vae.decoder.train()
    with single_frame_convs():
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, steps, lr)
            idx = rng.sample(range(len(frames)), batch)
            z = latents[idx] + noise * torch.randn(latents[idx].shape, generator=gen)
            if drawn is not None:
                half = batch // 2
                z[half:] = drawn[[rng.randrange(len(drawn)) for _ in range(half)], idx[half:]]
            y = decode_unclamped(vae, z)
            rec = (
                balanced_loss(y, frames[idx], scale[idx])
                if balance
                else reconstruction_loss(y, frames[idx], FG_WEIGHT, True)
            )
            opt.zero_grad(set_to_none=True)
            rec.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            if step % log_every == 0 or step == steps - 1:
                logger.info("video vae step %d/%d rec %.4f (%.0fs)", step, steps, rec.item(), timer())
            if (step + 1) % 200 == 0:
                save_checkpoint(
                    ckpt,
                    model=vae.state_dict(),
                    opt=opt.state_dict(),
                    step=step + 1,
                    rng=rng_state(),
                    pyrng=rng.getstate(),
                    gen=gen.get_state(),
                )
    vae.eval().requires_grad_(False)
    vae.save_pretrained(out / "vae")  # latents_mean/std unchanged: the encoder did not move
    after = ceiling(vae)
    logger.info("video vae: shape-kind ceiling after %s (%.0fs)", after, timer())
    return {"ceiling_before": before, "ceiling_after": after, "frames": len(frames)}


def redrawn(out: Path, model: Path, vae, clips, latents: torch.Tensor, seed: int, redraws: int) -> torch.Tensor:
    """``(redraws, N * F, C, 1, h, w)`` raw latents: ``redraws`` passes of ``video_vae_samples.redraw``
    of every frame of ``clips`` by the video model ``model`` (cached as ``OUT/redrawn.pt`` with the
    model's weight hashes and sampler, the seed, ``redraws`` and the clip count; else it redraws)."""
    path = out / "redrawn.pt"
    sampler = (Path(model) / "scheduler" / "scheduler_config.json").read_text()
    key = {"model": tree_sha256(model), "sampler": sampler, "seed": seed, "redraws": redraws, "clips": len(clips)}
    if path.is_file():
        cached = torch.load(path)
        if cached["key"] == key:
            return cached["latents"]
    from training.video_vae_samples import redraw

    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    x0 = (latents.squeeze(2).unflatten(0, (len(clips), -1)).transpose(1, 2) - mean) / std  # (N, C, F, h, w)
    passes = []
    for k in range(redraws):
        x = redraw(model, clips, x0, seed + 1000 * k) * std + mean  # (N, C, F, h, w) raw
        passes.append(x.transpose(1, 2).flatten(0, 1).unsqueeze(2))
    result = torch.stack(passes)
    torch.save({"key": key, "latents": result}, path)
    return result


def install(vae_dir: Path, model_dir: Path) -> None:
    """Write the VAE at ``vae_dir`` (``AutoencoderKLQwenImage``) as ``model_dir/vae`` (``AutoencoderKLWan``)."""
    import shutil

    from training.video_model import video_vae

    shutil.rmtree(model_dir / "vae", ignore_errors=True)
    video_vae(vae_dir).save_pretrained(model_dir / "vae")
    logger.info("video vae: %s written into %s", vae_dir, model_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.train_video_vae", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init", type=Path, default=IMAGE_VAE, help="start from this VAE (its encoder: the image VAE's)")
    p.add_argument("--balance", action="store_true", help="weight each frame by the inverse of its colour contrast")
    p.add_argument("--samples", type=Path, help="a video model whose redrawn latents half of every batch decodes")
    p.add_argument("--redraws", type=int, default=2, help="with --samples: redrawn passes over the train clips")
    p.add_argument("--into", type=Path, help="a video model directory whose vae/ to replace with the result")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup(args.seed)
    if not (args.out / "vae" / "config.json").is_file():
        timer = Timer()
        settings = {k: v for k, v in vars(args).items() if k != "into"}  # train_video_vae's own names
        result = train_video_vae(**settings)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
        record = {"settings": settings, "wall_seconds": round(timer()), **result}
        (args.out / "vae_training.json").write_text(json.dumps(record, indent=2) + "\n")
    if args.into:
        install(args.out / "vae", args.into)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
