"""Wan denoise stage: per-request noise and UniPC/flow sampler, one transformer call over stacked rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import WanPipeline

from triptych.accel.step_graphs import GraphCall
from triptych.families.base import Conditioning, DenoiseState, GenerationParams, Row
from triptych.families.guidance import cfg_combine


def prepare(family, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState:
    pipe = family.pipe
    scheduler = family.new_scheduler()
    scheduler.set_timesteps(params.steps, device=family.device)
    if not family.accepts_image:
        scheduler.set_begin_index(0)  # WanPipeline does this; WanImageToVideoPipeline does not
    # NOTE: WanPipeline.prepare_latents draws exactly the noise both pipelines draw (the i2v variant
    # also VAE-encodes the condition, which the encoder role already did); it reads only geometry.
    latents = WanPipeline.prepare_latents(
        pipe,
        1,
        family.latent_channels,
        params.height,
        params.width,
        params.frames,
        torch.float32,
        family.device,
        family.generator(params.seed),
    )
    return DenoiseState(request_id, params, latents, scheduler, scheduler.timesteps, cond)


def hidden_of(transformer, rows: Sequence[Row]) -> torch.Tensor:
    """The transformer's ``hidden_states`` for stacked rows: image-to-video adds mask ‖ condition latents."""
    states = [r.state for r in rows]
    if "condition" in states[0].cond.shared:
        hidden = torch.cat([torch.cat([s.latents, s.cond.shared["condition"]], dim=1) for s in states])
    else:
        hidden = torch.cat([s.latents for s in states])
    return hidden.to(transformer.dtype)


def transformer_inputs(transformer, rows: Sequence[Row]) -> dict:
    """The transformer's keyword arguments for stacked rows (TeaCache's split forward reuses them)."""
    states = [r.state for r in rows]
    image_embeds = None
    if "condition" in states[0].cond.shared:  # image-to-video: noise ‖ mask ‖ condition latents
        image_embeds = torch.cat([s.cond.shared["image_embeds"] for s in states])
    return dict(
        hidden_states=hidden_of(transformer, rows),
        timestep=torch.cat([s.timestep.expand(1) for s in states]),  # as the pipeline: t.expand(B)
        encoder_hidden_states=torch.cat([r.state.cond.branches[r.branch]["prompt_embeds"] for r in rows]),
        encoder_hidden_states_image=image_embeds,
    )


def forward(transformer, rows: Sequence[Row]) -> torch.Tensor:
    return transformer(**transformer_inputs(transformer, rows), attention_kwargs=None, return_dict=False)[0]


#: ``transformer_inputs``' arguments, every one per row
ROW_ARGS = frozenset({"hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"})


def graph_call(transformer, rows: Sequence[Row]) -> GraphCall:
    """``forward`` over ``rows`` as a step graph replays it (``accel/step_graphs.py``)."""

    def run(batch: int, **tensors):
        return transformer(**tensors, attention_kwargs=None, return_dict=False)[0]

    return GraphCall(run, transformer_inputs(transformer, rows), ROW_ARGS, len(rows))


def combine(state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
    return cfg_combine(preds, state.params.guidance)
