"""Where does the video model take the motion and the shape from: the prompt or the noisy latents?

``python -m training.diagnose_video --model DIR [--n 8]``

For ``n`` train clips (``sample_clips(n, "diagnose", "train")``) and each noise level ``s``, the
transformer's one-step prediction ``x0 = x_s - s * v`` from ``x_s = (1 - s) x0 + s e`` (short caption,
no guidance) is decoded and read back by the world's scorer. At ``s`` near 1 the latents hold almost
nothing of the clip, so a right direction or shape there comes from the prompt; sampling starts at
``s = 1``. Prints, per noise level, how many clips have the direction right and how many the shape
kind, colour and background on at least 80% of their frames (logged).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import torch

from shapeworld.video import clip_caption, render_clip, sample_clips
from shapeworld.video_scorer import score_clip

logger = logging.getLogger("training.diagnose_video")

LEVELS = (0.3, 0.6, 0.8, 0.95, 1.0)


@torch.no_grad()
def diagnose(model: Path, n: int = 8, levels=LEVELS, seed: int = 0) -> dict[float, dict[str, int]]:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(model)
    clips = sample_clips(n, "diagnose", "train")
    pix = torch.from_numpy(np.stack([render_clip(c) for c in clips]).astype(np.float32) / 127.5 - 1.0)
    pix = pix.permute(0, 4, 1, 2, 3)  # (N, 3, F, H, W)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    x0 = (pipe.vae.encode(pix).latent_dist.mode() - mean) / std
    embeds = pipe._get_t5_prompt_embeds(
        prompt=[clip_caption(c, "short") for c in clips], max_sequence_length=32, device="cpu"
    )
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    out = {}
    for s in levels:
        xs = (1 - s) * x0 + s * noise
        v = pipe.transformer(
            hidden_states=xs, timestep=torch.full((n,), 1000.0 * s), encoder_hidden_states=embeds, return_dict=False
        )[0]
        video = pipe.vae.decode((xs - s * v) * std + mean).sample.clamp(-1, 1)
        frames = ((video.permute(0, 2, 3, 4, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
        rows = [score_clip(f, c) for f, c in zip(frames, clips)]
        out[s] = {
            "direction": sum(bool(r["direction"]) for r in rows),
            **{k: sum(r[k] >= 0.8 for r in rows) for k in ("shape", "color", "background")},
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m training.diagnose_video", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--n", type=int, default=8)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    result = diagnose(args.model, args.n)
    for s, row in result.items():
        logger.info("s=%.2f %s", s, " ".join(f"{k} {v}/{args.n}" for k, v in row.items()))
    return result


if __name__ == "__main__":
    main()
