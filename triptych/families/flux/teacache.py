"""FLUX pieces for TeaCache (``triptych.accel.teacache``): the transformer forward split in four.

``FluxTransformer2DModel.forward`` is ``embed → double blocks → single blocks → norm_out/proj_out``.
The plan exposes those parts over a batch of rows so the cache can run the block stack on the rows
that compute only. ``head(e, blocks(e, None))`` runs exactly the ops of ``transformer(...)`` in the
same order on the same tensors, so it is bit-identical to ``denoise.forward`` (tests check it).

Modulated input (TeaCache4FLUX): the first double block's ``norm1`` applied to the embedded image
tokens with the row's temb (timestep + guidance + pooled text); its first output, the normalised and
shift/scale-modulated tokens.

Not covered: ControlNet residuals and IP-Adapter kwargs (the adapter passes neither).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triptych.accel.teacache import RowStep, TeaCachePlan
from triptych.families.base import Row
from triptych.families.flux.denoise import transformer_inputs


@dataclass
class FluxEmbedded:
    """Embedded batch: the inputs of the block stack for every row."""

    hidden: torch.Tensor  # (rows, img_seq, dim) after x_embedder
    encoder_hidden: torch.Tensor  # (rows, txt_seq, dim) after context_embedder
    temb: torch.Tensor  # (rows, dim) time (+ guidance) + pooled text embedding
    rotary: tuple[torch.Tensor, torch.Tensor]  # shared by the rows (same size and text length)


def describe(row: Row) -> RowStep:
    """Generic over families (uses only ``Row``/``DenoiseState``); other families can reuse it."""
    s = row.state
    coeffs = getattr(s.params, "teacache_coefficients", None)  # if GenerationParams grows the field
    return RowStep(
        s.request_id,
        row.branch,
        s.step,
        s.total_steps,
        s.params.teacache_threshold,
        tuple(coeffs) if coeffs is not None else None,
    )


def make_plan(transformer) -> TeaCachePlan:
    """Bind the four pieces to one loaded ``FluxTransformer2DModel``; holds no state of its own."""
    t = transformer

    def embed(rows: Sequence[Row]) -> FluxEmbedded:
        x = transformer_inputs(rows)
        hidden = t.x_embedder(x["hidden_states"])
        timestep = x["timestep"].to(hidden.dtype) * 1000
        pooled = x["pooled_projections"]
        if x["guidance"] is None:
            temb = t.time_text_embed(timestep, pooled)
        else:
            temb = t.time_text_embed(timestep, x["guidance"].to(hidden.dtype) * 1000, pooled)
        encoder_hidden = t.context_embedder(x["encoder_hidden_states"])
        rotary = t.pos_embed(torch.cat((x["txt_ids"], x["img_ids"]), dim=0))
        return FluxEmbedded(hidden, encoder_hidden, temb, rotary)

    def modulated_input(e: FluxEmbedded) -> torch.Tensor:
        return t.transformer_blocks[0].norm1(e.hidden, emb=e.temb)[0]

    def blocks(e: FluxEmbedded, idx: torch.Tensor | None) -> torch.Tensor:
        hidden, encoder_hidden, temb = e.hidden, e.encoder_hidden, e.temb
        if idx is not None:
            hidden, encoder_hidden, temb = hidden[idx], encoder_hidden[idx], temb[idx]
        for block in (*t.transformer_blocks, *t.single_transformer_blocks):
            encoder_hidden, hidden = block(
                hidden_states=hidden,
                encoder_hidden_states=encoder_hidden,
                temb=temb,
                image_rotary_emb=e.rotary,
                joint_attention_kwargs={},
            )
        return hidden

    def head(e: FluxEmbedded, hidden: torch.Tensor) -> torch.Tensor:
        return t.proj_out(t.norm_out(hidden, e.temb))

    return TeaCachePlan("flux", describe, embed, modulated_input, blocks, head)
