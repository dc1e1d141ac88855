"""Qwen-Image decode stage: unpack latents, undo the VAE's per-channel normalisation, decode one frame."""

from __future__ import annotations

import torch

from triptych.accel.frame_decode import decodes_frame
from triptych.families.base import Frames, GenerationParams, to_frames


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, params: GenerationParams, frame_decoder=None) -> Frames:
    """``latents``: the noise latents only (edit's image latents never enter the state's latents);
    ``frame_decoder``: ``--compile``'s one-frame decoder (``accel/frame_decode.py``), used unless tiling."""
    vae = pipe.vae
    latents = pipe._unpack_latents(latents, params.height, params.width, pipe.vae_scale_factor)
    latents = latents.to(vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    latents = latents / inv_std + mean
    if frame_decoder is not None and decodes_frame(vae, latents):
        image = frame_decoder(latents)[:, :, 0]
    else:
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
    return to_frames(pipe.image_processor.postprocess(image, output_type="np")[0])
