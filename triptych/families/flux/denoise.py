"""FLUX denoise stage: latents and per-request sampler, one transformer call over stacked rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triptych.accel.step_graphs import GraphCall
from triptych.families.base import Conditioning, DenoiseState, GenerationParams, Row
from triptych.families.guidance import cfg_combine
from triptych.families.sampling import flow_match_schedule


def prepare(family, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState:
    pipe = family.pipe
    channels = pipe.transformer.config.in_channels // 4
    latents, img_ids = pipe.prepare_latents(
        1, channels, params.height, params.width, family.dtype, family.device, family.generator(params.seed)
    )
    scheduler = family.new_scheduler()
    timesteps = flow_match_schedule(scheduler, params.steps, latents.shape[1], family.device)
    aux = {"img_ids": img_ids}
    if pipe.transformer.config.guidance_embeds:
        aux["guidance"] = torch.full([1], params.guidance, device=family.device, dtype=torch.float32)
    return DenoiseState(request_id, params, latents, scheduler, timesteps, cond, aux)


def transformer_inputs(rows: Sequence[Row]) -> dict:
    """The transformer's keyword arguments for stacked rows (TeaCache's split forward reuses them)."""
    states = [r.state for r in rows]
    hidden = torch.cat([s.latents for s in states])
    # Same ops as the pipeline: t.expand(B).to(latents.dtype) / 1000, one value per row.
    timestep = torch.cat([s.timestep.expand(1).to(hidden.dtype) for s in states]) / 1000
    guidance = torch.cat([s.aux["guidance"] for s in states]) if "guidance" in states[0].aux else None
    branch = [r.state.cond.branches[r.branch] for r in rows]
    return dict(
        hidden_states=hidden,
        timestep=timestep,
        guidance=guidance,
        pooled_projections=torch.cat([b["pooled_prompt_embeds"] for b in branch]),
        encoder_hidden_states=torch.cat([b["prompt_embeds"] for b in branch]),
        txt_ids=branch[0]["text_ids"],  # zeros (seq, 3): equal for every row of equal text length
        img_ids=states[0].aux["img_ids"],  # same size in a batch (compat key)
    )


def forward(transformer, rows: Sequence[Row]) -> torch.Tensor:
    return transformer(**transformer_inputs(rows), joint_attention_kwargs={}, return_dict=False)[0]


#: ``transformer_inputs``' per-row arguments (the ids are one table shared by every row)
ROW_ARGS = frozenset({"hidden_states", "timestep", "guidance", "pooled_projections", "encoder_hidden_states"})


def graph_call(transformer, rows: Sequence[Row]) -> GraphCall:
    """``forward`` over ``rows`` as a step graph replays it (``accel/step_graphs.py``)."""

    def run(batch: int, **tensors):
        return transformer(**tensors, joint_attention_kwargs={}, return_dict=False)[0]

    return GraphCall(run, transformer_inputs(rows), ROW_ARGS, len(rows))


def combine(state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
    return cfg_combine(preds, state.params.true_cfg)
