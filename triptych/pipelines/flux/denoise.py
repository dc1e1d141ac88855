"""FLUX denoise stage: latents and per-request sampler, one transformer call over stacked rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from triptych.pipelines.base import COND, UNCOND, Conditioning, DenoiseState, GenerationParams, Row


def prepare(family, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState:
    pipe = family.pipe
    channels = pipe.transformer.config.in_channels // 4
    latents, img_ids = pipe.prepare_latents(
        1, channels, params.height, params.width, family.dtype, family.device, family.generator(params.seed)
    )
    scheduler = family.new_scheduler()
    steps = params.steps
    sigmas = np.linspace(1.0, 1 / steps, steps)
    if getattr(scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    cfg = scheduler.config
    mu = calculate_shift(
        latents.shape[1],
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(scheduler, steps, family.device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    aux = {"img_ids": img_ids}
    if pipe.transformer.config.guidance_embeds:
        aux["guidance"] = torch.full([1], params.guidance, device=family.device, dtype=torch.float32)
    return DenoiseState(request_id, params, latents, scheduler, timesteps, cond, aux)


def forward(transformer, rows: Sequence[Row]) -> torch.Tensor:
    states = [r.state for r in rows]
    hidden = torch.cat([s.latents for s in states])
    # Same ops as the pipeline: t.expand(B).to(latents.dtype) / 1000, one value per row.
    timestep = torch.cat([s.timestep.expand(1).to(hidden.dtype) for s in states]) / 1000
    guidance = torch.cat([s.aux["guidance"] for s in states]) if "guidance" in states[0].aux else None
    branch = [r.state.cond.branches[r.branch] for r in rows]
    return transformer(
        hidden_states=hidden,
        timestep=timestep,
        guidance=guidance,
        pooled_projections=torch.cat([b["pooled_prompt_embeds"] for b in branch]),
        encoder_hidden_states=torch.cat([b["prompt_embeds"] for b in branch]),
        txt_ids=branch[0]["text_ids"],  # zeros (seq, 3): equal for every row of equal text length
        img_ids=states[0].aux["img_ids"],  # same size in a batch (compat key)
        joint_attention_kwargs={},
        return_dict=False,
    )[0]


def combine(state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
    pos = preds[COND]
    if UNCOND not in preds:
        return pos
    neg = preds[UNCOND]
    return neg + state.params.true_cfg * (pos - neg)
