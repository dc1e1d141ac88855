"""Stage 1: the AutoencoderKLQwenImage (8x spatial compression, z=16) trained to reconstruct world images.

Loss: L2 on pixels and on 8x8-pooled pixels of a posterior sample's decoding, plus a small KL term. Afterwards the
per-channel mean/std of the posterior means over every train scene become the VAE config's
``latents_mean``/``latents_std``, which the Qwen-Image pipelines use to normalise latents.
"""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path

import torch

from training import data
from training.common import (
    Timer,
    cosine_lr,
    resume_from,
    rng_state,
    save_checkpoint,
    seed_all,
    single_frame_convs,
)

logger = logging.getLogger("training.vae")


def build_vae(seed: int):
    from diffusers import AutoencoderKLQwenImage

    from training.common import dims

    d = dims()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(
        base_dim=d.vae_base_dim,
        z_dim=d.z_dim,
        dim_mult=list(d.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False] * (len(d.vae_dim_mult) - 1),
        latents_mean=[0.0] * d.z_dim,
        latents_std=[1.0] * d.z_dim,
    )
    # Start with a narrow posterior (std ~0.05): at unit variance the sampling noise drowns the
    # still-small means and the decoder settles on the mean image (loss plateau seen at ~2.0).
    with torch.no_grad():
        vae.quant_conv.bias[d.z_dim :] = -6.0
    return vae


#: Phase 1 learns backgrounds and layout; phase 2 (from phase 1's weights, fresh schedule) weights
#: shape pixels 5x: after phase 1 backgrounds read back 100% but shapes were faint.
#: Phase 3 trains the decoder only, on the frozen encoder's latents (plus a little noise, as sampled
#: latents are never exact) with the sharpness terms of ``reconstruction_loss``: the latent space the
#: transformer is trained on does not move, so the transformer trains at the same time.
#: ``jump``: how the collapse guard detects a jump of the smoothed loss over the last snapshot's
#: (phase 1 ran with an absolute margin; the fg-weighted loss is noisier, so later phases use a ratio).
PHASES = {
    1: dict(fg_weight=1.0, jump=("add", 0.15)),
    2: dict(fg_weight=5.0, jump=("mul", 1.5)),
    3: dict(fg_weight=5.0, decoder_only=True, sharp=True),
}


#: Phases that train the encoder; after the last of them the latent space is fixed, and the
#: transformer can train on it while the decoder-only phases run.
JOINT_PHASES = tuple(k for k, v in PHASES.items() if not v.get("decoder_only"))


def encoder_dir(out: Path) -> Path:
    """The VAE whose encoder (and ``latents_mean/std``) is final: the finished VAE, else the last joint phase's."""
    final = out / "vae"
    return final if (final / "config.json").is_file() else out / f"vae_phase{JOINT_PHASES[-1]}"


def train_vae(
    out: Path,
    seed: int,
    steps: int,
    phase: int = 1,
    batch: int = 16,
    lr: float = 5e-4,
    kl: float = 0.0,
    resume: bool = False,
    log_every: int = 25,
    ckpt_every: int = 100,
):
    """Phase k starts from ``out/vae_phase{k-1}`` and writes ``out/vae_phase{k}`` (the last phase: ``out/vae``)."""
    from diffusers import AutoencoderKLQwenImage

    out.mkdir(parents=True, exist_ok=True)
    dest = out / ("vae" if phase == len(PHASES) else f"vae_phase{phase}")
    if (dest / "config.json").is_file():
        logger.info("vae phase %d: done already (%s)", phase, dest)
        return
    fg_weight = PHASES[phase]["fg_weight"]
    seed_all(seed + 100 * (phase - 1))
    vae = build_vae(seed) if phase == 1 else AutoencoderKLQwenImage.from_pretrained(out / f"vae_phase{phase - 1}")
    if PHASES[phase].get("decoder_only"):
        return _train_decoder(
            vae,
            out,
            dest,
            seed,
            steps,
            phase,
            batch,
            lr,
            fg_weight,
            resume,
            log_every,
            ckpt_every,
            PHASES[phase].get("noise", 0.1),
            PHASES[phase].get("sharp", False),
        )
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    ckpt = out / f"vae{phase}.ckpt"
    start, state = resume_from(ckpt, resume, vae, opt)
    if state:
        logger.info("vae: resumed at step %d", start)
    scenes = list(data.train_scenes())
    rng = random.Random(f"{seed}|vae" if phase == 1 else f"{seed}|vae|{phase}")
    if state:
        rng.setstate(state["pyrng"])
    how, margin = PHASES[phase]["jump"]
    timer = Timer()
    vae.train()
    # Collapse guard: with 4-channel RMS norms (they normalise per pixel over the channels) a step
    # can blow up and leave the decoder drawing the mean image for good. Keep a snapshot every 50
    # steps; if the smoothed loss jumps well above the snapshot's, go back to it with half the lr.
    smooth, snapshot, scale = None, None, state.get("scale", 1.0) if state else 1.0
    with single_frame_convs():
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, steps, lr) * scale
            x = data.pixels(rng.sample(scenes, batch))
            post = vae.encode(x).latent_dist
            z = post.sample() if kl > 0 else post.mode()
            y = decode_unclamped(vae, z)
            # Full-resolution MSE plus MSE of 8x8-pooled images (colour and layout: a 4-channel-wide run
            # learnt shape and position but collapsed colour onto one axis).
            rec = reconstruction_loss(y, x, fg_weight)
            kl_term = 0.5 * (post.mean.pow(2) + post.var - 1.0 - post.logvar).mean()
            loss = rec + kl * kl_term
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 0.5)
            opt.step()
            smooth = rec.item() if smooth is None else 0.9 * smooth + 0.1 * rec.item()
            if step % 50 == 0:
                limit = snapshot[0] + margin if snapshot and how == "add" else snapshot[0] * margin if snapshot else 0
                if snapshot is not None and smooth > limit:
                    scale *= 0.5
                    vae.load_state_dict(snapshot[1])
                    opt.load_state_dict(snapshot[2])
                    smooth = snapshot[0]
                    logger.info("vae step %d: loss jumped; back to the last snapshot, lr x%.2f", step, scale)
                else:
                    snapshot = (smooth, copy.deepcopy(vae.state_dict()), copy.deepcopy(opt.state_dict()))
            if step % log_every == 0 or step == steps - 1:
                logger.info("vae step %d/%d rec %.4f kl %.2f (%.0fs)", step, steps, rec.item(), kl_term.item(), timer())
            if (step + 1) % ckpt_every == 0:
                save_checkpoint(
                    ckpt,
                    model=vae.state_dict(),
                    opt=opt.state_dict(),
                    step=step + 1,
                    rng=rng_state(),
                    pyrng=rng.getstate(),
                    scale=scale,
                )
        vae.eval()
        mean, std = latent_stats(vae, scenes)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    vae.save_pretrained(dest)
    logger.info(
        f"vae phase {phase}: saved (%.0fs); latents mean %s std %s",
        timer(),
        [round(v, 2) for v in mean],
        [round(v, 2) for v in std],
    )


def _train_decoder(
    vae, out, dest, seed, steps, phase, batch, lr, fg_weight, resume, log_every, ckpt_every, noise_std=0.1, sharp=False
):
    params = decoder_only(vae)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    scenes = list(data.train_scenes())
    with single_frame_convs():
        latents = encode_mode(vae.eval(), scenes)
    noise = noise_std * latents.std(dim=(0, 2, 3, 4), keepdim=True)
    rng = random.Random(f"{seed}|vae|{phase}")
    ckpt = out / f"vae{phase}.ckpt"
    start, _ = resume_from(ckpt, resume, vae, opt, rng)
    timer = Timer()
    vae.decoder.train()
    with single_frame_convs():
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, steps, lr)
            idx = rng.sample(range(len(scenes)), batch)
            x = data.pixels([scenes[i] for i in idx])
            z = latents[idx] + noise * torch.randn_like(latents[idx])
            y = decode_unclamped(vae, z)
            rec = reconstruction_loss(y, x, fg_weight, sharp)
            opt.zero_grad(set_to_none=True)
            rec.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            if step % log_every == 0 or step == steps - 1:
                logger.info("vae decoder step %d/%d rec %.4f (%.0fs)", step, steps, rec.item(), timer())
            if (step + 1) % ckpt_every == 0:
                save_checkpoint(
                    ckpt,
                    model=vae.state_dict(),
                    opt=opt.state_dict(),
                    step=step + 1,
                    rng=rng_state(),
                    pyrng=rng.getstate(),
                )
    vae.eval().requires_grad_(True)
    vae.save_pretrained(dest)  # latents_mean/std unchanged: the encoder did not move
    logger.info("vae phase %d (decoder only): saved (%.0fs)", phase, timer())


def decoder_only(vae) -> list[torch.nn.Parameter]:
    """Freeze the VAE but its decoder and ``post_quant_conv``; returns their parameters."""
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    vae.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


def reconstruction_loss(y: torch.Tensor, x: torch.Tensor, fg_weight: float, sharp: bool = False) -> torch.Tensor:
    """Shape-weighted L2 plus L2 of 8x8-pooled images; ``sharp`` adds shape-weighted L1 on pixels and
    L1 on their horizontal/vertical differences. L2 alone leaves small squares and crosses as round blobs (the
    mean of the plausible outlines), which the scorer reads as circles; L1 is median-seeking and the
    difference terms put a price on soft edges and rounded corners."""
    weight = 1.0 + (fg_weight - 1.0) * data.shape_mask(x)
    loss = ((y - x).pow(2) * weight).mean() / weight.mean() + (_pool(y) - _pool(x)).pow(2).mean()
    if sharp:
        loss = loss + ((y - x).abs() * weight).mean() / weight.mean()
        for dim in (-1, -2):
            dy, dx = y.diff(dim=dim), x.diff(dim=dim)
            loss = loss + (dy - dx).abs().mean()
    return loss


def _pool(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.avg_pool2d(x[:, :, 0], 8)


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode`` of one frame without its final clamp to [-1, 1] (which zeroes gradients)."""
    vae.clear_cache()
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=vae._feat_map, feat_idx=[0])
    vae.clear_cache()
    return out


@torch.no_grad()
def encode_mode(vae, scenes, batch: int = 64) -> torch.Tensor:
    """Posterior means (N, z, 1, h, w), unnormalised."""
    out = [vae.encode(data.pixels(scenes[i : i + batch])).latent_dist.mode() for i in range(0, len(scenes), batch)]
    return torch.cat(out)


def latent_stats(vae, scenes) -> tuple[list[float], list[float]]:
    z = encode_mode(vae, scenes)
    flat = z.transpose(0, 1).reshape(z.shape[1], -1)
    return flat.mean(1).tolist(), flat.std(1).clamp_min(1e-3).tolist()


@torch.no_grad()
def reconstruction_accuracy(vae, scenes) -> dict[str, float]:
    from shapeworld import accuracy, score

    x = data.pixels(scenes)
    with single_frame_convs():
        y = vae.decode(vae.encode(x).latent_dist.mode()).sample
    arr = ((y[:, :, 0].permute(0, 2, 3, 1).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
    return accuracy([score(a, s) for a, s in zip(arr, scenes)])
