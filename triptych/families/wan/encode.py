"""Wan encode stage: UMT5 prompt embeddings; for image-to-video also the CLIP image embeddings and
the VAE-encoded first-frame condition, all via the pipeline's own methods."""

from __future__ import annotations

import torch

from triptych.families.base import COND, UNCOND, Conditioning, GenerationParams


def encode_text(pipe, params: GenerationParams, cfg: bool, max_sequence_length: int, dtype, device) -> Conditioning:
    """Prompt (and, with CFG, negative prompt; diffusers' default is ``""``) → padded embeddings."""
    embeds, negative = pipe.encode_prompt(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        do_classifier_free_guidance=cfg,
        num_videos_per_prompt=1,
        max_sequence_length=max_sequence_length,
        device=device,
    )
    branches = {COND: {"prompt_embeds": embeds.to(dtype)}}
    if cfg:
        branches[UNCOND] = {"prompt_embeds": negative.to(dtype)}
    return Conditioning(branches=branches)


def encode_image(pipe, params: GenerationParams, dtype, device) -> dict[str, torch.Tensor]:
    """The condition image → ``image_embeds`` (CLIP penultimate layer) and ``condition``.

    ``condition`` is the pipeline's ``prepare_latents`` second output: the 4-channel first-frame mask
    concatenated with the normalised VAE latents of [image, zeros...] (argmax, so seed-independent).
    """
    image_embeds = pipe.encode_image(params.image, device).repeat(1, 1, 1).to(dtype)
    image = pipe.video_processor.preprocess(params.image, height=params.height, width=params.width)
    image = image.to(device, dtype=torch.float32)
    # NOTE: passing ``latents`` makes prepare_latents skip its noise draw (the denoiser role draws
    # the noise from the seed in ``prepare``); it only reads the placeholder's device and dtype.
    placeholder = torch.empty(0, device=device, dtype=torch.float32)
    z_dim = pipe.vae.config.z_dim
    _, condition = pipe.prepare_latents(
        image, 1, z_dim, params.height, params.width, params.frames, torch.float32, device, None, placeholder
    )
    return {"image_embeds": image_embeds, "condition": condition}
