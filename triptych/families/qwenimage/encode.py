"""Qwen-Image encode stage: Qwen2.5-VL prompt embeddings; for edit also the condition image's latents.

Everything goes through the pipeline's own methods (``encode_prompt``, ``image_processor``,
``_encode_vae_image``, ``_pack_latents``) so the tensors equal those of its ``__call__``.
"""

from __future__ import annotations

import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

from triptych.families.base import COND, UNCOND, Conditioning, GenerationParams

#: QwenImageEditPipeline resizes every condition image to about this many pixels (hard-coded there).
#: A model's ``triptych.json`` may set its own ``condition_area`` (the packaged default model was
#: trained with 64x64 condition images); real checkpoints keep the pipeline's.
EDIT_CONDITION_AREA = 1024 * 1024


def encode_text(pipe, params: GenerationParams, cfg: bool, max_sequence_length: int, device) -> Conditioning:
    """``device``: the pipeline's execution device (``Family.execution_device``)."""

    def one(prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask = pipe.encode_prompt(prompt=prompt, device=device, max_sequence_length=max_sequence_length)
        return _branch(embeds, mask)

    branches = {COND: one(params.prompt)}
    if cfg:
        branches[UNCOND] = one(params.negative_prompt)
    return Conditioning(branches=branches)


def condition_size(image, area: int = EDIT_CONDITION_AREA) -> tuple[int, int]:
    """(height, width) the edit pipeline resizes a condition image to, from its aspect ratio."""
    # Looked up on the pipeline module at call time, as its __call__ does (tests shrink the area there).
    ratio = image.size[0] / image.size[1]
    width, height, _ = pipeline_qwenimage_edit.calculate_dimensions(area, ratio)
    return height, width


def encode_edit(
    pipe,
    params: GenerationParams,
    cfg: bool,
    max_sequence_length: int,
    dtype,
    device,
    area: int = EDIT_CONDITION_AREA,
) -> Conditioning:
    """Prompt embeddings (text + vision tokens of the resized image) and the image's packed VAE latents.

    ``shared["image_latents"]`` (1, tokens, 4·z) joins the noise latents along the sequence at every
    step; ``shared["image_shape"]`` is its (frames, height, width) in 2×2 patches, for RoPE.
    """
    height, width = condition_size(params.image, area)
    prompt_image = pipe.image_processor.resize(params.image, height, width)
    pixels = pipe.image_processor.preprocess(prompt_image, height, width).unsqueeze(2)

    def one(prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask = pipe.encode_prompt(
            image=prompt_image, prompt=prompt, device=device, max_sequence_length=max_sequence_length
        )
        return _branch(embeds, mask)

    branches = {COND: one(params.prompt)}
    if cfg:
        branches[UNCOND] = one(params.negative_prompt)
    # Same ops as QwenImageEditPipeline.prepare_latents (argmax sampling: the generator is unused).
    latents = pipe._encode_vae_image(image=pixels.to(device=device, dtype=dtype), generator=None)
    latent_h, latent_w = latents.shape[3:]
    packed = pipe._pack_latents(latents, 1, pipe.latent_channels, latent_h, latent_w)
    scale = pipe.vae_scale_factor
    shape = torch.tensor([1, height // scale // 2, width // scale // 2], dtype=torch.long)
    return Conditioning(branches=branches, shared={"image_latents": packed, "image_shape": shape})


def _branch(embeds: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    # NOTE: one prompt has no padding, so encode_prompt returns mask=None; padding (and its mask) is
    # added per batch in denoise.forward, where prompts of different lengths meet.
    assert mask is None, "a single prompt's embeddings carry no padding"
    return {"prompt_embeds": embeds}
