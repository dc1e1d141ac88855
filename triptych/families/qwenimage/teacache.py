"""Qwen-Image / Qwen-Image-Edit pieces for TeaCache (``triptych.accel.teacache``): the forward split in four.

``QwenImageTransformer2DModel.forward`` (diffusers 0.42.1) is ``img_in / txt_norm+txt_in / time_text_embed
/ pos_embed → dual-stream blocks → norm_out/proj_out``. ``embed`` runs the first part over the rows
exactly as ``denoise.forward`` calls the transformer (same inputs: right-padded text with its mask when
lengths differ, the edit condition latents concatenated to the noise tokens); ``blocks`` runs the block
stack on all rows or a sub-batch of them (text, mask, temb and ``modulate_index`` sliced alike);
``head`` runs ``norm_out`` with every row's own temb, ``proj_out``, and keeps the noise tokens (the
edit condition tokens are dropped, as ``denoise.forward`` does). ``head(e, blocks(e, None))`` runs the
same ops in the same order on the same tensors as ``denoise.forward``: bit-identical (tests check it).
Rows whose states carry the step tables (``qwenimage/fast.py``) take the fast path's own embed, blocks
and head instead, which are the family's forward for them: again bit-identical to ``family.forward``.

The cached residual is the image stream's (noise tokens and, for edit, the condition-image tokens);
the text stream is not needed after the blocks (the model's output reads only the image stream).

Modulated input (TeaCache reference for Qwen-Image): the first block's ``img_mod(temb)`` first
shift/scale applied to ``img_norm1(hidden)``, i.e. the modulated image-stream input of block 0's
attention. With ``zero_cond_t`` (Qwen-Image-Edit-2511 style checkpoints) the condition-image tokens
are modulated with the t=0 embedding, as the block does (``modulate_index``).

Not covered: ControlNet residuals and ``additional_t_cond`` (the adapter passes neither); a
``guidance`` embedding (the adapter passes ``guidance=None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

from triptych.accel.teacache import TeaCachePlan
from triptych.families.base import Row
from triptych.families.flux.teacache import describe  # family-independent (Row/DenoiseState only)
from triptych.families.qwenimage import fast
from triptych.families.qwenimage.denoise import transformer_inputs


@dataclass
class QwenEmbedded:
    """Embedded batch: the inputs of the block stack for every row."""

    hidden: torch.Tensor  # (rows, img_seq, dim) after img_in; edit: noise ‖ condition tokens
    encoder_hidden: torch.Tensor  # (rows, txt_seq, dim) after txt_norm/txt_in (right-padded)
    mask: torch.Tensor | None  # (rows, txt_seq) bool, None when every row has the same text length
    temb: torch.Tensor  # (rows, dim); with zero_cond_t (2 * rows, dim): t rows then t=0 rows
    rotary: tuple[torch.Tensor, torch.Tensor]  # shared by the rows (same image shapes, padded text length)
    modulate_index: torch.Tensor | None  # (rows, img_seq) 0 = noise token, 1 = condition; zero_cond_t only
    noise_tokens: int  # image-stream tokens that are the output (the rest is the edit condition)


def make_plan(transformer, vae_scale_factor: int, family_name: str = "qwen-image", quick=None) -> TeaCachePlan:
    """Bind the pieces to one loaded ``QwenImageTransformer2DModel``; holds no state of its own.
    ``quick``: the family's ``fast.FastForward``; rows it can run (``fast.usable``) take its pieces,
    so the split forward stays bit-identical to ``family.forward`` on either path."""
    t = transformer

    def embed(rows: Sequence[Row]):
        if quick is not None and fast.usable(t, rows):
            return quick.embed(rows)
        return plain_embed(rows)

    def modulated_input(e) -> torch.Tensor:
        return quick.modulated_input(e) if isinstance(e, fast.FastEmbedded) else plain_modulated_input(e)

    def blocks(e, idx: torch.Tensor | None) -> torch.Tensor:
        return quick.blocks(e, idx) if isinstance(e, fast.FastEmbedded) else plain_blocks(e, idx)

    def head(e, hidden: torch.Tensor) -> torch.Tensor:
        return quick.head(e, hidden) if isinstance(e, fast.FastEmbedded) else plain_head(e, hidden)

    def plain_embed(rows: Sequence[Row]) -> QwenEmbedded:
        x, noise_tokens = transformer_inputs(rows, vae_scale_factor)
        hidden = t.img_in(x["hidden_states"])
        timestep = x["timestep"].to(hidden.dtype)
        modulate_index = None
        if t.zero_cond_t:
            timestep = torch.cat([timestep, timestep * 0], dim=0)
            modulate_index = torch.tensor(
                [[0] * prod(sample[0]) + [1] * sum([prod(s) for s in sample[1:]]) for sample in x["img_shapes"]],
                device=timestep.device,
                dtype=torch.int,
            )
        encoder_hidden = t.txt_in(t.txt_norm(x["encoder_hidden_states"]))
        text_seq_len, _, mask = compute_text_seq_len_from_mask(encoder_hidden, x["encoder_hidden_states_mask"])
        temb = t.time_text_embed(timestep, hidden, None)
        rotary = t.pos_embed(x["img_shapes"], max_txt_seq_len=text_seq_len, device=hidden.device)
        return QwenEmbedded(hidden, encoder_hidden, mask, temb, rotary, modulate_index, noise_tokens)

    def plain_modulated_input(e: QwenEmbedded) -> torch.Tensor:
        block = t.transformer_blocks[0]
        img_mod1 = block.img_mod(e.temb).chunk(2, dim=-1)[0]
        return block._modulate(block.img_norm1(e.hidden), img_mod1, e.modulate_index)[0]

    def plain_blocks(e: QwenEmbedded, idx: torch.Tensor | None) -> torch.Tensor:
        hidden, encoder_hidden, mask, temb, index = e.hidden, e.encoder_hidden, e.mask, e.temb, e.modulate_index
        if idx is not None:
            hidden, encoder_hidden = hidden[idx], encoder_hidden[idx]
            mask = mask[idx] if mask is not None else None
            if index is not None:  # zero_cond_t: temb is (t rows ‖ t=0 rows)
                index = index[idx]
                temb = temb[torch.cat([idx, idx + e.hidden.shape[0]])]
            else:
                temb = temb[idx]
        for block in t.transformer_blocks:
            encoder_hidden, hidden = block(
                hidden_states=hidden,
                encoder_hidden_states=encoder_hidden,
                encoder_hidden_states_mask=mask,
                temb=temb,
                image_rotary_emb=e.rotary,
                joint_attention_kwargs={},
                modulate_index=index,
            )
        return hidden

    def plain_head(e: QwenEmbedded, hidden: torch.Tensor) -> torch.Tensor:
        temb = e.temb.chunk(2, dim=0)[0] if t.zero_cond_t else e.temb
        return t.proj_out(t.norm_out(hidden, temb))[:, : e.noise_tokens]

    return TeaCachePlan(family_name, describe, embed, modulated_input, blocks, head)
