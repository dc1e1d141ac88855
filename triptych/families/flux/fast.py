"""FLUX's step without what is constant per request: computed once at ``prepare`` (issue 27 item 1).

In ``FluxTransformer2DModel.forward`` (diffusers 0.42.1) two inputs of the blocks never change
within a request: the rotary embedding ``pos_embed(cat(txt_ids, img_ids))`` (float64 trigonometry
over every token, each step) and each CFG branch's ``context_embedder(prompt_embeds)``. The timestep
embedding differs per branch (it adds the branch's pooled text) and per step, so nothing is reused
there; the text stream is updated by every block, so its projections stay in the step.
``request_tables`` computes both with the model's own modules on one row's shapes; ``forward`` is
the model's forward with them: the RoPE for any batch (it is per token, the same for every row of a
batch: same size, same text length), the context for a forward of one row (a matmul over stacked
rows does not give the same bits as one per row, so several rows project theirs as the model
does). The same bits as the model's forward in both cases (tests/pipelines/test_step_tables.py).

On a large FLUX this is a small share of a forward; on the tiny one, a larger share. ``usable``: no LoRA row (an adapter may change the
context embedder), no hook on the model, 2-D ids (the adapter's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triptych.families.base import DenoiseState, Row
from triptych.families.fastpath import model_hooked
from triptych.families.flux.denoise import transformer_inputs


@dataclass
class FluxTables:
    """One request's constants (``DenoiseState.step_consts``)."""

    context: dict[str, torch.Tensor]  # branch -> (1, L, dim) after context_embedder
    rotary: tuple[torch.Tensor, torch.Tensor]  # pos_embed of (txt_ids ‖ img_ids)


@torch.no_grad()
def request_tables(transformer, state: DenoiseState) -> FluxTables:
    t = transformer
    branches = state.cond.branches
    context = {b: t.context_embedder(v["prompt_embeds"]) for b, v in branches.items()}
    txt_ids = next(iter(branches.values()))["text_ids"]  # as transformer_inputs: the first row's
    rotary = t.pos_embed(torch.cat((txt_ids, state.aux["img_ids"]), dim=0))
    return FluxTables(context, rotary)


def usable(transformer, rows: Sequence[Row]) -> bool:
    t = transformer
    if model_hooked(t):
        return False  # a hook on the model expects its forward to run
    if any(r.state.params.lora or r.state.step_consts is None for r in rows):
        return False
    s = rows[0].state
    return s.aux["img_ids"].ndim == 2 and next(iter(s.cond.branches.values()))["text_ids"].ndim == 2


@torch.no_grad()
def forward(transformer, rows: Sequence[Row]) -> torch.Tensor:
    """``FluxTransformer2DModel.forward`` (no ControlNet, no IP-Adapter) with the request's tables."""
    t = transformer
    x = transformer_inputs(rows)
    hidden = t.x_embedder(x["hidden_states"])
    timestep = x["timestep"].to(hidden.dtype) * 1000
    if x["guidance"] is None:
        temb = t.time_text_embed(timestep, x["pooled_projections"])
    else:
        temb = t.time_text_embed(timestep, x["guidance"].to(hidden.dtype) * 1000, x["pooled_projections"])
    if len(rows) == 1:
        context = rows[0].state.step_consts.context[rows[0].branch]
    else:
        context = t.context_embedder(x["encoder_hidden_states"])
    rotary = rows[0].state.step_consts.rotary
    for block in (*t.transformer_blocks, *t.single_transformer_blocks):
        context, hidden = block(
            hidden_states=hidden,
            encoder_hidden_states=context,
            temb=temb,
            image_rotary_emb=rotary,
            joint_attention_kwargs={},
        )
    return t.proj_out(t.norm_out(hidden, temb))
