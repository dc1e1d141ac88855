"""Wan's step without what is constant per request: computed once at ``prepare`` (issue 27 item 1).

In ``WanTransformer3DModel`` (diffusers 0.42.1) the text never changes inside a request: the
condition embedder's text (and, image-to-video, image) projection, and in every block the
cross-attention's keys and values (``norm_k(to_k(text))``, ``to_v(text)``, and the image context's
``norm_added_k(add_k_proj(.))``, ``add_v_proj(.)``) read only it. On the small Wan those are 512
text tokens against a few dozen video tokens: most of a step's matmul work. ``request_tables``
computes them per CFG branch, and for both branches stacked as a fused-CFG forward of the request
stacks them, and per step the one-row timestep embedding and its ``time_proj``, with the model's own
modules on those shapes, so every value has the bits the model's forward computes for those rows.
``FastForward`` then runs the model's forward with them: the self-attention and the feed-forward
as the block does (its modules), the cross-attention as ``WanAttnProcessor`` does minus the
key/value projections (native SDPA, the same permutes). Other batches (several requests in one
step) compute context, keys and values batched as the model does, because a matmul over stacked
rows does not give the same bits as one per row. Result: the model's bits for any rows
(tests/pipelines/test_step_tables.py; test_wan.py against pristine diffusers); TeaCache's split
forward (``wan/teacache.py``) takes these pieces, so it stays bit-identical to ``family.forward``.

``usable`` says when it applies: tables present (the request's key/value tables fit
``TABLE_BYTES``), no LoRA row, diffusers' own processor with the native attention backend and
unfused projections, no hooks on the model, blocks not compiled; otherwise the model's forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from triptych.families.base import COND, UNCOND, DenoiseState, Row
from triptych.families.fastpath import hooked, model_hooked, native_attention

#: Largest per-request key/value table (bytes, all branches); above it the step runs the model's forward.
#: The small Wan's is 12.6 MB; Wan 2.1 14B's would be ~1.7 GB.
TABLE_BYTES = 256 << 20


@dataclass
class WanTables:
    """One request's per-step constants (``DenoiseState.step_consts``)."""

    text: dict[str, torch.Tensor]  # branch -> (1, [image +] text tokens, dim): the blocks' context
    kv: dict[str, list[tuple]]  # branch -> per block (key, value, image key | None, image value | None)
    #: (context, kv) of both branches stacked (cond, uncond) as a fused-CFG forward has them; None without CFG
    pair: tuple[torch.Tensor, list[tuple]] | None
    temb: torch.Tensor  # (steps, 1, dim)
    timestep_proj: torch.Tensor  # (steps, 1, 6, dim)


def _kv(attn, context: torch.Tensor) -> tuple:
    """The cross-attention's keys and values, as ``WanAttnProcessor`` computes them from the context."""
    image = None
    if attn.add_k_proj is not None:  # the processor's split: 512 text tokens, the image context before them
        image_context_length = context.shape[1] - 512
        image, text = context[:, :image_context_length], context[:, image_context_length:]
    else:
        text = context
    key = attn.norm_k(attn.to_k(text)).unflatten(2, (attn.heads, -1))
    value = attn.to_v(text).unflatten(2, (attn.heads, -1))
    if image is None:
        return key, value, None, None
    key_img = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (attn.heads, -1))
    return key, value, key_img, attn.add_v_proj(image).unflatten(2, (attn.heads, -1))


def _context(ce, prompt_embeds: torch.Tensor, image_embeds: torch.Tensor | None) -> torch.Tensor:
    """The blocks' context as the condition embedder and the model's forward build it."""
    context = ce.text_embedder(prompt_embeds)
    if image_embeds is not None:
        context = torch.concat([ce.image_embedder(image_embeds), context], dim=1)
    return context


def _time(ce, timestep: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(temb, timestep_proj (rows, 6, dim)) as ``WanTimeTextImageEmbedding`` computes them."""
    proj = ce.timesteps_proj(timestep)
    time_dtype = next(iter(ce.time_embedder.parameters())).dtype
    if proj.dtype != time_dtype and time_dtype != torch.int8:
        proj = proj.to(time_dtype)
    temb = ce.time_embedder(proj).type_as(like)
    return temb, ce.time_proj(ce.act_fn(temb)).unflatten(1, (6, -1))


def _image_embeds(state: DenoiseState) -> torch.Tensor | None:
    return state.cond.shared["image_embeds"] if "condition" in state.cond.shared else None  # as transformer_inputs


@torch.no_grad()
def request_tables(transformer, state: DenoiseState) -> WanTables | None:
    """One branch alone and both CFG branches stacked (as a fused-CFG forward of the request stacks
    them), each with the model's modules on those shapes; None past ``TABLE_BYTES``."""
    t = transformer
    ce = t.condition_embedder
    image = _image_embeds(state)
    branches = state.cond.branches
    text = {b: _context(ce, v["prompt_embeds"], image) for b, v in branches.items()}
    kv = {b: [_kv(blk.attn2, c) for blk in t.blocks] for b, c in text.items()}
    pair = None
    if COND in branches and UNCOND in branches:
        embeds = torch.cat([branches[b]["prompt_embeds"] for b in (COND, UNCOND)])
        context = _context(ce, embeds, torch.cat([image, image]) if image is not None else None)
        pair = (context, [_kv(blk.attn2, context) for blk in t.blocks])
    kvs = [*kv.values()] + ([pair[1]] if pair is not None else [])
    if sum(x.numel() * x.element_size() for v in kvs for blk in v for x in blk if x is not None) > TABLE_BYTES:
        return None
    like = next(iter(branches.values()))["prompt_embeds"]  # the model's type_as(encoder_hidden_states)
    tembs, projs = zip(*(_time(ce, ts.expand(1), like) for ts in state.timesteps))  # one row each
    return WanTables(text, kv, pair, torch.stack(tembs), torch.stack(projs))


def usable(transformer, rows: Sequence[Row]) -> bool:
    t = transformer
    if model_hooked(t):
        return False
    if any(r.state.params.lora or r.state.step_consts is None for r in rows):
        return False
    for block in t.blocks:
        # NOTE: torch has no public way to ask whether a module was compiled (``nn.Module.compile``)
        if getattr(block, "_compiled_call_impl", None) is not None or hooked(block):
            return False
        for attn in (block.attn1, block.attn2):
            p = attn.processor
            if type(p) is not WanAttnProcessor or not native_attention(p) or attn.fused_projections:
                return False
    return True


def _attend(q, k, v):
    """``dispatch_attention_fn`` with the native backend, no mask: (B, S, H, D) in and out."""
    q, k, v = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)
    return out.permute(0, 2, 1, 3)


def _cross(attn, hidden, kv):
    """``WanAttnProcessor`` for the cross-attention with its keys and values given."""
    key, value, key_img, value_img = kv
    query = attn.norm_q(attn.to_q(hidden)).unflatten(2, (attn.heads, -1))
    out_img = None
    if key_img is not None:
        out_img = _attend(query, key_img, value_img).flatten(2, 3).type_as(query)
    out = _attend(query, key, value).flatten(2, 3).type_as(query)
    if out_img is not None:
        out = out + out_img
    return attn.to_out[1](attn.to_out[0](out))


def _block(block, hidden, context, temb, rotary, kv):
    """``WanTransformerBlock.forward`` (Wan 2.1 modulation: temb (B, 6, dim)) with cross-attention K/V given."""
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
        block.scale_shift_table + temb.float()
    ).chunk(6, dim=1)
    norm_hidden = (block.norm1(hidden.float()) * (1 + scale_msa) + shift_msa).type_as(hidden)
    attn_output = block.attn1(norm_hidden, None, None, rotary)
    hidden = (hidden.float() + attn_output * gate_msa).type_as(hidden)
    norm_hidden = block.norm2(hidden.float()).type_as(hidden)
    hidden = hidden + _cross(block.attn2, norm_hidden, kv)
    norm_hidden = (block.norm3(hidden.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden)
    ff_output = block.ffn(norm_hidden)
    return (hidden.float() + ff_output.float() * c_gate_msa).type_as(hidden)


@dataclass
class FastEmbedded:
    hidden: torch.Tensor  # (rows, tokens, dim)
    context: torch.Tensor  # (rows, [image +] text tokens, dim)
    kv: list[tuple]  # per block, the rows' keys/values stacked
    temb: torch.Tensor  # (rows, dim)
    timestep_proj: torch.Tensor  # (rows, 6, dim)
    rotary: tuple[torch.Tensor, torch.Tensor]
    shape: tuple[int, int, int, int]  # (rows, frames, height, width) after patchify


class FastForward:
    """The model's forward with a request's tables; the RoPE cached per latent shape."""

    def __init__(self, transformer):
        self.t = transformer
        self._rope: dict[tuple, tuple] = {}

    def embed(self, rows: Sequence[Row], hidden: torch.Tensor) -> FastEmbedded:
        t = self.t
        batch_size, _, num_frames, height, width = hidden.shape
        key = (tuple(hidden.shape[2:]), hidden.device, hidden.dtype)
        if key not in self._rope:
            self._rope[key] = t.rope(hidden)
        p_t, p_h, p_w = t.config.patch_size
        hidden = t.patch_embedding(hidden).flatten(2).transpose(1, 2).contiguous()
        states = [r.state for r in rows]
        tables = states[0].step_consts
        if len(rows) == 1:  # the branch's own tables
            context, kv = tables.text[rows[0].branch], tables.kv[rows[0].branch]
            temb, proj = tables.temb[states[0].step], tables.timestep_proj[states[0].step]
        else:  # as the model computes them for these rows, batched (a matmul per row has other bits)
            pair = len(rows) == 2 and states[1] is states[0] and tables.pair is not None
            if pair and rows[0].branch == COND and rows[1].branch == UNCOND:
                context, kv = tables.pair  # this request's fused CFG rows: its own constants
            else:
                images = [_image_embeds(s) for s in states]
                embeds = torch.cat([s.cond.branches[r.branch]["prompt_embeds"] for s, r in zip(states, rows)])
                context = _context(t.condition_embedder, embeds, None if images[0] is None else torch.cat(images))
                kv = [_kv(blk.attn2, context) for blk in t.blocks]
            like = states[0].cond.branches[rows[0].branch]["prompt_embeds"]
            timestep = torch.cat([s.timestep.expand(1) for s in states])
            temb, proj = _time(t.condition_embedder, timestep, like)
        shape = (batch_size, num_frames // p_t, height // p_h, width // p_w)
        return FastEmbedded(hidden, context, kv, temb, proj, self._rope[key], shape)

    def blocks(self, e: FastEmbedded, idx: torch.Tensor | None = None) -> torch.Tensor:
        hidden, context, temb, kv = e.hidden, e.context, e.timestep_proj, e.kv
        if idx is not None:
            hidden, context, temb = hidden[idx], context[idx], temb[idx]
            kv = [tuple(None if x is None else x[idx] for x in blk) for blk in kv]
        for block, block_kv in zip(self.t.blocks, kv):
            hidden = _block(block, hidden, context, temb, e.rotary, block_kv)
        return hidden

    def head(self, e: FastEmbedded, hidden: torch.Tensor) -> torch.Tensor:
        """As the model's forward after the blocks (and ``wan/teacache.py``'s head)."""
        t = self.t
        shift, scale = (t.scale_shift_table.to(e.temb.device) + e.temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (t.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = t.proj_out(hidden)
        batch_size, frames, height, width = e.shape
        p_t, p_h, p_w = t.config.patch_size
        hidden = hidden.reshape(batch_size, frames, height, width, p_t, p_h, p_w, -1)
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @torch.no_grad()
    def __call__(self, rows: Sequence[Row], hidden: torch.Tensor) -> torch.Tensor:
        e = self.embed(rows, hidden)
        return self.head(e, self.blocks(e))
