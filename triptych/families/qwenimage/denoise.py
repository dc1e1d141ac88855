"""Qwen-Image denoise stage: per-request latents and sampler, one transformer call over stacked rows.

Rows of one call may carry prompts of different token lengths: they are right-padded with zeros
and ``encoder_hidden_states_mask`` marks the padding. In diffusers 0.42.1 the transformer turns that
mask into a joint (text + image) key mask for attention, and text RoPE positions are ``0..L-1`` from
the left for every row, so right padding leaves each row's valid tokens at the positions they have
alone; only kernel reduction order changes (see the batched tolerance in the tests). With equal
lengths (always true for one row) no mask is passed, exactly as the pipeline does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triptych.accel.step_graphs import GraphCall
from triptych.families.base import Conditioning, DenoiseState, GenerationParams, Row
from triptych.families.guidance import cfg_combine_norm_rescaled
from triptych.families.sampling import flow_match_schedule


def prepare(family, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState:
    pipe = family.pipe
    channels = pipe.transformer.config.in_channels // 4
    args = (1, channels, params.height, params.width, family.dtype, family.device, family.generator(params.seed))
    if family.accepts_image:  # the edit pipeline's prepare_latents also returns (here: no) image latents
        latents, _ = pipe.prepare_latents(None, *args)
    else:
        latents = pipe.prepare_latents(*args)
    scheduler = family.new_scheduler()
    timesteps = flow_match_schedule(scheduler, params.steps, latents.shape[1], family.device)
    return DenoiseState(request_id, params, latents, scheduler, timesteps, cond)


def image_shapes(state: DenoiseState, vae_scale_factor: int) -> list[tuple[int, int, int]]:
    """RoPE shapes of one row's image-stream segments: the noise latents, then edit's condition image."""
    p = state.params
    shapes = [(1, p.height // vae_scale_factor // 2, p.width // vae_scale_factor // 2)]
    if "image_shape" in state.cond.shared:
        shapes.append(tuple(int(v) for v in state.cond.shared["image_shape"]))
    return shapes


def pad_prompts(embeds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack (1, L_i, D) prompt embeddings into (B, max L, D); a mask only when lengths differ."""
    longest = max(e.shape[1] for e in embeds)
    if all(e.shape[1] == longest for e in embeds):
        return torch.cat(embeds), None
    padded = [torch.cat([e, e.new_zeros(1, longest - e.shape[1], e.shape[2])], dim=1) for e in embeds]
    mask = torch.zeros(len(embeds), longest, dtype=torch.long, device=embeds[0].device)
    for i, e in enumerate(embeds):
        mask[i, : e.shape[1]] = 1
    return torch.cat(padded), mask


def transformer_inputs(rows: Sequence[Row], vae_scale_factor: int) -> tuple[dict, int]:
    """The transformer's keyword arguments for stacked rows, and how many leading output tokens are
    the noise prediction (edit appends the condition image's tokens). TeaCache reuses it."""
    states = [r.state for r in rows]
    latents = torch.cat([s.latents for s in states])
    noise_tokens = latents.shape[1]
    hidden = latents
    if "image_latents" in states[0].cond.shared:
        image_latents = torch.cat([s.cond.shared["image_latents"] for s in states])
        hidden = torch.cat([latents, image_latents], dim=1)
    # Same ops as the pipeline: t.expand(B).to(latents.dtype), then / 1000; one value per row.
    timestep = torch.cat([s.timestep.expand(1).to(latents.dtype) for s in states])
    embeds, mask = pad_prompts([r.state.cond.branches[r.branch]["prompt_embeds"] for r in rows])
    # Equal for every row of a batch (compat key: same size and condition-image shape).
    shapes = [image_shapes(states[0], vae_scale_factor)] * len(rows)
    kwargs = dict(
        hidden_states=hidden,
        timestep=timestep / 1000,
        encoder_hidden_states_mask=mask,
        encoder_hidden_states=embeds,
        img_shapes=shapes,
    )
    return kwargs, noise_tokens


def forward(transformer, rows: Sequence[Row], vae_scale_factor: int) -> torch.Tensor:
    kwargs, noise_tokens = transformer_inputs(rows, vae_scale_factor)
    out = transformer(**kwargs, guidance=None, attention_kwargs={}, return_dict=False)[0]
    return out[:, :noise_tokens]


#: ``transformer_inputs``' tensor arguments, every one per row (``img_shapes`` is a setting)
ROW_ARGS = frozenset({"hidden_states", "timestep", "encoder_hidden_states_mask", "encoder_hidden_states"})


def graph_call(transformer, rows: Sequence[Row], vae_scale_factor: int) -> GraphCall:
    """``forward`` over ``rows`` as a step graph replays it (``accel/step_graphs.py``): the image
    segments' shapes and the noise tokens are settings of the graph, the same for every row."""
    kwargs, noise_tokens = transformer_inputs(rows, vae_scale_factor)
    shapes = kwargs.pop("img_shapes")[0]

    def run(batch: int, **tensors):
        out = transformer(**tensors, img_shapes=[shapes] * batch, guidance=None, attention_kwargs={}, return_dict=False)
        return out[0][:, :noise_tokens]

    return GraphCall(run, kwargs, ROW_ARGS, len(rows), (tuple(shapes), noise_tokens))


def combine(state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
    """True CFG with Qwen's rescale: the combined prediction keeps the cond prediction's per-token norm."""
    return cfg_combine_norm_rescaled(preds, state.params.guidance)
