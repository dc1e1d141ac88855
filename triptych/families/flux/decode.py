"""FLUX decode stage: unpack latents, undo VAE scaling/shift, decode, postprocess."""

from __future__ import annotations

import torch

from triptych.families.base import Frames, GenerationParams, to_frames


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, params: GenerationParams) -> Frames:
    vae = pipe.vae
    latents = pipe._unpack_latents(latents, params.height, params.width, pipe.vae_scale_factor)
    latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    image = vae.decode(latents, return_dict=False)[0]
    return to_frames(pipe.image_processor.postprocess(image, output_type="np")[0])
