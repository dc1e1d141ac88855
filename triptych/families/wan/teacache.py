"""Wan 2.1 (T2V and I2V) pieces for TeaCache (``triptych.accel.teacache``): the forward split in four.

``WanTransformer3DModel.forward`` (diffusers 0.42.1) is ``rope / patch_embedding / condition_embedder
(time, text, CLIP image) → blocks → norm_out with scale_shift_table + temb, proj_out, unpatchify``.
``embed`` runs the first part over the rows exactly as ``denoise.forward`` calls the transformer
(I2V: noise ‖ mask+condition latents on the channel axis, CLIP image tokens before the text);
``blocks`` runs the block stack on all rows or a sub-batch of them (text and ``timestep_proj``
sliced alike; RoPE depends on the shape only); ``head`` runs the output modulation with every row's
own ``temb``, ``proj_out`` and the unpatchify. ``head(e, blocks(e, None))`` runs the same ops in the
same order on the same tensors as ``denoise.forward``: bit-identical (tests check it).

Modulated input (documented choice): the timestep embedding after ``time_projection``, ``e0`` in the
Wan reference code (diffusers' ``timestep_proj``, (rows, 6, dim)), the per-block shift/scale/gate
source. TeaCache4Wan2.1 uses ``e0`` or the pre-projection ``e`` depending on its ``use_ret_steps``
option, each with its own coefficients; a profile fitted here is for ``e0``. It depends on the
timestep only, so the cond and uncond rows of a request measure the same change (each still keeps
its own accumulated value and residual), and requests on the same schedule make the same decisions.

Rows whose states carry the step tables (``wan/fast.py``: text context, cross-attention keys and
values, temb) take the fast path's embed, blocks and head, which are the family's forward for them:
``head(e, blocks(e, None))`` stays bit-identical to ``family.forward`` on either path.

Not covered: Wan 2.2 (per-token timesteps, ``temb.ndim == 3``; refused by the family at load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triptych.accel.teacache import TeaCachePlan
from triptych.families.base import Row
from triptych.families.flux.teacache import describe  # family-independent (Row/DenoiseState only)
from triptych.families.wan import fast
from triptych.families.wan.denoise import hidden_of, transformer_inputs


@dataclass
class WanEmbedded:
    """Embedded batch: the inputs of the block stack for every row."""

    hidden: torch.Tensor  # (rows, tokens, dim) after patch_embedding
    encoder_hidden: torch.Tensor  # (rows, [image tokens +] text tokens, dim) after the embedders
    temb: torch.Tensor  # (rows, dim) time embedding (output modulation)
    timestep_proj: torch.Tensor  # (rows, 6, dim) per-block modulation ("e0")
    rotary: tuple[torch.Tensor, torch.Tensor]  # shared by the rows (same latent shape)
    shape: tuple[int, int, int, int]  # (rows, frames, height, width) after patchify


def make_plan(transformer, family_name: str = "wan-t2v", quick=None) -> TeaCachePlan:
    """Bind the pieces to one loaded ``WanTransformer3DModel``; holds no state of its own.
    ``quick``: the family's ``fast.FastForward``; rows it can run (``fast.usable``) take its pieces,
    so the split forward stays bit-identical to ``family.forward`` on either path."""
    t = transformer

    def embed(rows: Sequence[Row]):
        if quick is not None and fast.usable(t, rows):
            return quick.embed(rows, hidden_of(t, rows))
        return plain_embed(rows)

    def blocks(e, idx: torch.Tensor | None) -> torch.Tensor:
        return quick.blocks(e, idx) if isinstance(e, fast.FastEmbedded) else plain_blocks(e, idx)

    def head(e, hidden: torch.Tensor) -> torch.Tensor:
        return quick.head(e, hidden) if isinstance(e, fast.FastEmbedded) else plain_head(e, hidden)

    def plain_embed(rows: Sequence[Row]) -> WanEmbedded:
        x = transformer_inputs(t, rows)
        hidden = x["hidden_states"]
        batch_size, _, num_frames, height, width = hidden.shape
        p_t, p_h, p_w = t.config.patch_size
        rotary = t.rope(hidden)
        hidden = t.patch_embedding(hidden)
        hidden = hidden.flatten(2).transpose(1, 2)
        hidden = hidden.contiguous()
        timestep = x["timestep"]
        if timestep.ndim != 1:
            raise ValueError("Wan TeaCache plan: per-token timesteps (Wan 2.2) are not supported")
        temb, timestep_proj, encoder_hidden, encoder_hidden_image = t.condition_embedder(
            timestep, x["encoder_hidden_states"], x["encoder_hidden_states_image"], timestep_seq_len=None
        )
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        if encoder_hidden_image is not None:
            encoder_hidden = torch.concat([encoder_hidden_image, encoder_hidden], dim=1)
        shape = (batch_size, num_frames // p_t, height // p_h, width // p_w)
        return WanEmbedded(hidden, encoder_hidden, temb, timestep_proj, rotary, shape)

    def modulated_input(e) -> torch.Tensor:  # WanEmbedded or fast.FastEmbedded
        return e.timestep_proj

    def plain_blocks(e: WanEmbedded, idx: torch.Tensor | None) -> torch.Tensor:
        hidden, encoder_hidden, timestep_proj = e.hidden, e.encoder_hidden, e.timestep_proj
        if idx is not None:
            hidden, encoder_hidden, timestep_proj = hidden[idx], encoder_hidden[idx], timestep_proj[idx]
        for block in t.blocks:
            hidden = block(hidden, encoder_hidden, timestep_proj, e.rotary)
        return hidden

    def plain_head(e: WanEmbedded, hidden: torch.Tensor) -> torch.Tensor:
        temb = e.temb
        shift, scale = (t.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        shift = shift.to(hidden.device)
        scale = scale.to(hidden.device)
        hidden = (t.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = t.proj_out(hidden)
        batch_size, frames, height, width = e.shape
        p_t, p_h, p_w = t.config.patch_size
        hidden = hidden.reshape(batch_size, frames, height, width, p_t, p_h, p_w, -1)
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    return TeaCachePlan(family_name, describe, embed, modulated_input, blocks, head)
