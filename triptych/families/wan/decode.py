"""Wan decode stage: undo the per-channel latent normalisation, VAE-decode, postprocess to frames."""

from __future__ import annotations

import torch

from triptych.families.base import Frames, GenerationParams, to_frames


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, params: GenerationParams) -> Frames:
    vae = pipe.vae
    latents = latents.to(device=vae.device, dtype=vae.dtype)
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    latents = latents / inv_std + mean  # the pipeline's exact arithmetic (divide by 1/std)
    video = vae.decode(latents, return_dict=False)[0]
    return to_frames(pipe.video_processor.postprocess_video(video, output_type="np")[0])
