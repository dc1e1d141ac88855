"""The video transformer's own latents of train clips, for fine-tuning the VAE decoder on them.

The decoder was fine-tuned on the frozen encoder's latents, but at serving time it decodes the
transformer's: blobs whose outline wobbles between a circle and a square, which the decoder then
draws as such. Here each train clip's latents are noised to ``x_s = (1 - s) x0 + s e`` with ``s``
drawn from ``SIGMA_RANGE`` (where the outline is decided but the position still comes from the
clip), and the trained model redraws them from ``s`` to 0 exactly as it samples (its own scheduler,
steps, guidance and the clip's short caption). The result is paired with the clip's rendered frames:
the decoder learns to draw what the clip shows from what the transformer draws for it. Train clips
only (held-out combinations are never seen).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from shapeworld.video import Clip, clip_caption
from training.common import Timer

logger = logging.getLogger("training.video_vae_samples")
#: Noise levels the clip's latents are redrawn from (the served schedule's own sigmas in this range).
SIGMA_RANGE = (0.5, 0.85)


@torch.no_grad()
def redraw(model_dir: Path, clips: list[Clip], x0: torch.Tensor, seed: int, batch: int = 16) -> torch.Tensor:
    """``(N, C, F, h, w)`` normalised latents: ``x0`` (the clips' normalised latents) noised to a
    sigma of the model's schedule in :data:`SIGMA_RANGE` and sampled back to 0 by the model."""
    from diffusers import WanPipeline

    defaults = json.loads((model_dir / "triptych.json").read_text())
    pipe = WanPipeline.from_pretrained(model_dir, vae=None)
    gen = torch.Generator().manual_seed(seed)
    timer = Timer()
    pipe.scheduler.set_timesteps(defaults["steps"], device="cpu")
    lo, hi = SIGMA_RANGE
    allowed = [k for k, s in enumerate(pipe.scheduler.sigmas[:-1].tolist()) if lo <= s <= hi]
    out = []
    for i in range(0, len(clips), batch):
        chunk, x = clips[i : i + batch], x0[i : i + batch]
        start = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
        noise = torch.randn(x.shape, generator=gen)
        out.append(sample_from(pipe, x, [clip_caption(c, "short") for c in chunk], defaults, start, noise))
        if i % (10 * batch) == 0:
            logger.info("redraw: %d/%d clips (%.0fs)", i + len(chunk), len(clips), timer())
    return torch.cat(out)


def sample_from(pipe, x0, prompts: list[str], defaults: dict, start: int, noise: torch.Tensor) -> torch.Tensor:
    """``x0`` noised with ``noise`` to the sigma of step ``start`` of the model's schedule, then
    sampled to 0 by WanPipeline's own loop (scheduler, guidance, negative prompt ``""``)."""
    pos, neg = pipe.encode_prompt(
        prompt=prompts,
        negative_prompt=[""] * len(prompts),
        do_classifier_free_guidance=True,
        max_sequence_length=defaults["max_sequence_length"],
        device="cpu",
    )
    scheduler = pipe.scheduler
    scheduler.set_timesteps(defaults["steps"], device="cpu")
    s = scheduler.sigmas[start]
    latents = (1 - s) * x0 + s * noise
    scheduler.set_begin_index(start)
    for t in scheduler.timesteps[start:]:
        timestep = t.expand(latents.shape[0])
        cond = pipe.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=pos)[0]
        uncond = pipe.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=neg)[0]
        pred = uncond + defaults["guidance"] * (cond - uncond)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents
