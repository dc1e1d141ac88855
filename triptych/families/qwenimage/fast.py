"""Qwen-Image's step without its per-step overhead: what is constant per request is computed at ``prepare``.

A forward of the default model is ~960 operators on a few dozen tokens (benchmarks/RESULTS.md, "Step
overhead"): Python and dispatch. What is constant is computed once, with the transformer's own
modules on the shapes its forward would use, so every value has the bits that forward computes:

- at ``prepare`` (``tables``): each CFG branch's text stream input ``txt_in(txt_norm(.))``, and both
  branches' padded and stacked as a fused-CFG forward has them (a several-request batch's is kept on
  its first request while its rows stay: ``batch_text``);
- at a step's first one-row forward (``step_entry``), for the other branch too: the timestep
  embedding, every block's modulation as (shift, 1 + scale, gate), ``norm_out``'s (1 + scale, shift).
  Several rows compute these batched, as the model does (a matmul over stacked rows does not give
  the bits of one per row), every block's modulation in one matmul (``modulation``).

The blocks run ``fast_block.joint_block`` where it applies, else as their modules. With ``--compile``
they and the head run as one compiled graph (``fast_stack.py``) when every block takes
``joint_block``, reading each step's modulation from tables of the whole schedule made at ``prepare``
(one batch: not the model's bits, as the compiled stack is not; kept where they fit
``SCHEDULE_BYTES``); otherwise every block is called as a module, so its compiled graph runs. The
copies (fused q/k/v and modulation, the stack's operands) are rebuilt when ``fastpath.Stamp`` sees a
weight replaced, changed in place or hooked. ``usable`` says when the path applies (not: a LoRA row,
``zero_cond_t``, another processor or attention backend, hooks on the model).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from triptych.families.base import COND, UNCOND, DenoiseState, Row
from triptych.families.fastpath import Stamp, hooked, model_hooked, native_attention
from triptych.families.qwenimage.denoise import image_shapes, pad_prompts
from triptych.families.qwenimage.fast_block import joint_block, linears, norms, operands
from triptych.families.qwenimage.fast_stack import FrozenStack, compile_stack, stack_inputs

#: Largest concatenation of every block's modulation weights fused into one matmul per step; above
#: it each block's ``img_mod``/``txt_mod`` runs on its own
FUSED_MOD_BYTES = 64 << 20
#: the largest schedule table (every step's temb, modulation and head's) a ``--compile`` request keeps
SCHEDULE_BYTES = 64 << 20


@dataclass
class QwenTables:
    """One request's constants (``DenoiseState.step_consts``)."""

    text: dict[str, torch.Tensor]  # branch -> (1, L, dim) after txt_norm/txt_in
    #: both CFG branches (cond, uncond) as one forward stacks them: (2, max L, dim) and the bool text
    #: mask (None for equal lengths); None without CFG
    pair: tuple[torch.Tensor, torch.Tensor | None] | None
    step: int = -1  # the step of ``entry``: the one-row (temb, modulation, norm_out's)
    entry: tuple | None = None
    #: ``--compile`` only: every step's (temb, modulation, norm_out's), (steps, ...) each; None: per step
    schedule: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: the last several-row batch this request led: (its prompts as weak references, the weights'
    #: ``FastForward.epoch``, text, mask)
    batch: tuple | None = None


@dataclass
class FastEmbedded:
    """``FastForward.embed``'s batch: the block stack's inputs for every row."""

    hidden: torch.Tensor  # (rows, img_seq, dim) after img_in; edit: noise ‖ condition tokens
    txt: torch.Tensor  # (rows, txt_seq, dim) after txt_norm/txt_in, right-padded
    mask: torch.Tensor | None  # (rows, txt_seq) bool, None when every row has the same text length
    joint_mask: torch.Tensor | None  # (rows, 1, 1, txt_seq + img_seq) bool: the attention key mask
    temb: torch.Tensor  # (rows, dim)
    mods: torch.Tensor | None  # (blocks, 2, 6, dim) for one row, (blocks, 2, 6, rows, 1, dim); None: modules
    head: torch.Tensor | None  # norm_out's (1 + scale, shift): (2, dim) or (2, rows, 1, dim)
    rope: tuple  # (img freqs, txt freqs, joint freqs, (img, txt) as the model's pos_embed returns them)
    noise_tokens: int
    stack: FrozenStack | None = None  # the compiled stack the blocks run as; None: eager

    @property
    def frozen(self) -> bool:
        return self.stack is not None


def usable(transformer, rows: Sequence[Row]) -> bool:
    """Whether ``FastForward`` computes what the transformer's own forward would (the module doc)."""
    if transformer.zero_cond_t or model_hooked(transformer):
        return False  # a hook on the model expects its forward to run
    if any(r.state.params.lora or r.state.step_consts is None for r in rows):
        return False
    for block in transformer.transformer_blocks:
        p = block.attn.processor
        if type(p) is not QwenDoubleStreamAttnProcessor2_0 or not native_attention(p):
            return False
    return True


def from_schedule(states: Sequence[DenoiseState]) -> tuple | None:
    """The rows' (temb, modulation, norm_out's) at their steps from the schedule tables, shaped as
    ``FastForward.embed`` shapes its own; None when a state has none."""
    if any(s.step_consts.schedule is None for s in states):
        return None
    (temb, mods, head), step = states[0].step_consts.schedule, states[0].step
    if len(states) == 1:
        return temb[step : step + 1], mods[step], head[step]
    if all(s is states[0] for s in states):  # one request's rows (its CFG branches): its row, broadcast
        n, mods, head = len(states), mods[step][:, :, :, None, None], head[step][:, None, None]
        return temb[step : step + 1].expand(n, -1), mods.expand(-1, -1, -1, n, 1, -1), head.expand(-1, n, 1, -1)
    temb, mods, head = (torch.stack([s.step_consts.schedule[i][s.step] for s in states]) for i in range(3))
    return temb, mods.permute(1, 2, 3, 0, 4).unsqueeze(4), head.permute(1, 0, 2).unsqueeze(2)


class FastForward:
    """The fast forward bound to one transformer, its copies rebuilt by ``refresh`` when stale."""

    def __init__(self, transformer, vae_scale_factor: int, idle=None, compile_device=None, cuda_graphs=False):
        """``idle()``: ids of forward hooks that add nothing to a forward this class runs (the LoRA
        runtime's: the fast path runs no row with an adapter); None = every hook counts.
        ``compile_device``: ``--compile``'s device (the blocks as one compiled graph; their modules
        are compiled too), None: eager. ``cuda_graphs``: that graph replays as CUDA graphs."""
        self.t, self.vae_scale_factor, self.idle = transformer, vae_scale_factor, idle or frozenset
        self.compile_device, self.cuda_graphs = compile_device, cuda_graphs
        self._rope: dict[tuple, tuple] = {}
        self._stamp: Stamp | None = None
        self._stack: FrozenStack | None = None
        self.epoch = 0  # counts ``refresh``'s rebuilds: what a kept batch text was made under

    def refresh(self) -> None:
        """Rebuild the copies unless ``Stamp.holds``: each block's ``Operands`` (None: runs as its
        module), the fused modulation weights, the compiled stack's operands."""
        idle, t = self.idle(), self.t
        if self._stamp is not None and self._stamp.holds(idle):
            return
        blocks = list(t.transformer_blocks)
        self.ops = [operands(b, idle) for b in blocks]
        mods = self.mod_linears = [lin for b in blocks for lin in (b.img_mod[1], b.txt_mod[1])] + [t.norm_out.linear]
        self.mod_hooked = any(hooked(m, idle) for m in mods)
        fuse = not self.mod_hooked and sum(m.weight.numel() * m.weight.element_size() for m in mods) <= FUSED_MOD_BYTES
        fuse = fuse and all(type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter for m in mods)
        fuse = fuse and all(m.bias is not None for m in mods)
        self._mod = (
            (torch.cat([m.weight for m in mods]).detach(), torch.cat([m.bias for m in mods]).detach()) if fuse else None
        )
        head, self.stack = (t.norm_out.norm, t.proj_out), None
        if self.compile_device is not None and None not in self.ops:
            if self._stack is None:
                self._stack = compile_stack(self.ops, head, self.compile_device, self.cuda_graphs)
            else:
                self._stack.load(self.ops, head)
            self.stack = self._stack
        self.stack_head = not hooked(t.proj_out, idle)
        self.keep_text = not (hooked(t.txt_in, idle) or hooked(t.txt_norm, idle))
        lins = [m for b in blocks for m in linears(b)] + mods + [t.proj_out, t.txt_in]
        owners = [(m, n) for m in lins for n in ("weight", "bias")]
        owners += [(n, "weight") for b in blocks for n in norms(b)]
        owners += [(t.norm_out.norm, "weight"), (t.norm_out.norm, "bias"), (t.txt_norm, "weight")]
        self._stamp = Stamp(owners, [*blocks, *lins, t.txt_norm], idle)
        self.epoch += 1

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's (shift, 1 + scale, gate) ×2 per stream and ``norm_out``'s (1 + scale, shift)
        for ``temb`` (rows, dim): ((rows, blocks, 2, 6, dim), (rows, 2, dim)). Several rows: one matmul
        against the modulation linears' weights concatenated (they all read ``silu(temb)``); one row,
        a matrix-vector product whose kernel may sum in another order when the output is 12x longer
        (1.8e-7 off the model's on an AVX-512 CPU): each linear on its own, as the model runs it."""
        blocks, dim = len(self.ops), temb.shape[-1]
        if self._mod is not None and temb.shape[0] > 1:
            table = F.linear(F.silu(temb), *self._mod)
        else:
            table = torch.cat([m(F.silu(temb)) for m in self.mod_linears], dim=-1)
        mods = table[:, : blocks * 12 * dim].reshape(-1, blocks, 2, 2, 3, dim)
        mods[:, :, :, :, 1] += 1  # _modulate's (1 + scale)
        head = table[:, blocks * 12 * dim :].reshape(-1, 2, dim)
        head[:, 0] += 1  # norm_out's (1 + scale)
        return mods.reshape(-1, blocks, 2, 6, dim), head

    def _temb(self, state: DenoiseState, timesteps: torch.Tensor) -> torch.Tensor:
        dtype = self.t.img_in.weight.dtype
        timesteps = (timesteps.to(state.latents.dtype) / 1000).to(dtype)
        return self.t.time_text_embed(timesteps, state.latents.new_empty(0, dtype=dtype), None)

    @torch.no_grad()
    def tables(self, state: DenoiseState) -> QwenTables:
        """The request's text constants, as the model's forward computes them: one branch alone, and
        both stacked and padded as a fused-CFG forward of this request; with ``--compile``, the
        schedule tables (one batch over every step) where they fit ``SCHEDULE_BYTES``."""
        t, branches = self.t, state.cond.branches
        text = {b: t.txt_in(t.txt_norm(v["prompt_embeds"])) for b, v in branches.items()}
        pair = None
        if COND in branches and UNCOND in branches:
            embeds, mask = pad_prompts([branches[b]["prompt_embeds"] for b in (COND, UNCOND)])
            pair = (t.txt_in(t.txt_norm(embeds)), mask.to(torch.bool) if mask is not None else None)
        tables = QwenTables(text, pair)
        w = t.img_in.weight
        per_step = (len(t.transformer_blocks) * 12 + 3) * w.shape[0] * w.element_size()
        if self.compile_device is not None and len(state.timesteps) * per_step <= SCHEDULE_BYTES:
            tables.schedule = self.schedule(state)
        return tables

    def schedule(self, state: DenoiseState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temb, modulation, norm_out's) of every step of ``state``'s schedule, one batch of rows."""
        self.refresh()
        temb = self._temb(state, state.timesteps)
        return (temb, *self.modulation(temb))

    def step_entry(self, state: DenoiseState, modular: bool) -> tuple:
        """(temb, modulation, norm_out's) for one row of ``state`` at its step, once per step."""
        tables = state.step_consts
        if tables.step != state.step or tables.entry is None or (tables.entry[1] is None) != modular:
            temb = self._temb(state, state.timestep.expand(1))
            mods = head = None
            if not modular:  # (blocks, 2, 6, dim) and (2, dim): broadcast over the row and its tokens
                mods, head = (x[0] for x in self.modulation(temb))
            tables.step, tables.entry = state.step, (temb, mods, head)
        return tables.entry

    def batch_text(self, tables: QwenTables, prompts: list[torch.Tensor]) -> tuple:
        """(text, bool mask or None) of ``prompts`` padded as one batch, kept on ``tables`` (the batch's
        first request) while its prompts are the same tensors and the weights the same ``epoch``."""
        kept = tables.batch
        if self.keep_text and kept is not None and kept[1] == self.epoch and len(kept[0]) == len(prompts):
            if all(ref() is p for ref, p in zip(kept[0], prompts)):
                return kept[2], kept[3]
        embeds, mask = pad_prompts(prompts)
        txt, mask = self.t.txt_in(self.t.txt_norm(embeds)), mask.to(torch.bool) if mask is not None else None
        tables.batch = (tuple(weakref.ref(p) for p in prompts), self.epoch, txt, mask) if self.keep_text else None
        return txt, mask

    def rotary(self, shapes: list[tuple[int, int, int]], text_len: int, device):
        key = (tuple(shapes), text_len, device)
        if key not in self._rope:
            vid, txt = self.t.pos_embed([shapes], max_txt_seq_len=text_len, device=device)
            joint = torch.cat([txt[:, None, None], vid[:, None, None]])  # text first, as the joint sequence
            self._rope[key] = (vid.unsqueeze(1), txt.unsqueeze(1), joint, (vid, txt))
        return self._rope[key]

    @torch.no_grad()
    def embed(self, rows: Sequence[Row]) -> FastEmbedded:
        """The block stack's inputs for ``rows`` (the part of the model's forward before the blocks)."""
        self.refresh()
        t, states = self.t, [r.state for r in rows]
        latents = states[0].latents if len(rows) == 1 else torch.cat([s.latents for s in states])
        noise_tokens = latents.shape[1]
        if "image_latents" in states[0].cond.shared:
            latents = torch.cat([latents, torch.cat([s.cond.shared["image_latents"] for s in states])], dim=1)
        hidden = t.img_in(latents)
        stack = self.stack
        compiled = self.compile_device is not None  # the blocks' modules are compiled
        modular = stack is None and (compiled or self.mod_hooked or not any(self.ops))
        scheduled = from_schedule(states) if stack is not None else None
        if len(rows) == 1:  # the request's tables
            txt, mask = states[0].step_consts.text[rows[0].branch], None
            temb, mods, head = scheduled or self.step_entry(states[0], modular)
        else:  # as the model's forward computes them for these rows, batched (the same bits as it)
            pair = states[0].step_consts.pair
            if (
                len(rows) == 2
                and states[1] is states[0]
                and pair is not None
                and rows[0].branch == COND != rows[1].branch
            ):
                txt, mask = pair  # this request's fused CFG rows (cond, uncond): its own text constants
            else:
                prompts = [r.state.cond.branches[r.branch]["prompt_embeds"] for r in rows]
                txt, mask = self.batch_text(states[0].step_consts, prompts)
            if scheduled is not None:
                temb, mods, head = scheduled
            else:
                timestep = torch.cat([s.timestep.expand(1).to(latents.dtype) for s in states]) / 1000
                temb, mods, head = t.time_text_embed(timestep.to(hidden.dtype), hidden, None), None, None
                if not modular:  # (blocks, 2, 6, rows, 1, dim) and (2, rows, 1, dim)
                    mods, head = self.modulation(temb)
                    mods, head = mods.permute(1, 2, 3, 0, 4).unsqueeze(4), head.permute(1, 0, 2).unsqueeze(2)
        rope = self.rotary(image_shapes(states[0], self.vae_scale_factor), txt.shape[1], hidden.device)
        joint = None
        if mask is not None:  # the processor's joint (text ‖ image) key mask, once instead of per block
            image_mask = torch.ones((hidden.shape[0], 1, 1, hidden.shape[1]), dtype=torch.bool, device=hidden.device)
            joint = torch.cat([mask[:, None, None], image_mask], dim=-1)
        return FastEmbedded(hidden, txt, mask, joint, temb, mods, head, rope, noise_tokens, stack)

    def modulated_input(self, e: FastEmbedded) -> torch.Tensor:
        """Block 0's modulated image-stream input (TeaCache's distance), as ``qwenimage/teacache.py``."""
        block = self.t.transformer_blocks[0]
        if e.mods is None:
            img_mod1 = block.img_mod(e.temb).chunk(2, dim=-1)[0]
            return block._modulate(block.img_norm1(e.hidden), img_mod1)[0]
        shift, scale = e.mods[0][0][0], e.mods[0][0][1]
        return F.layer_norm(e.hidden, block.img_norm1.normalized_shape, None, None, block.img_norm1.eps) * scale + shift

    @torch.no_grad()
    def blocks(self, e: FastEmbedded, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The block stack on every row, or on the rows ``idx`` (TeaCache's sub-batches); the image stream."""
        return self.run(e, idx)[0]

    def run(self, e: FastEmbedded, idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``blocks``, and the compiled stack's head output where it ran them, else None."""
        hidden, txt, mask, joint, temb, mods, head = e.hidden, e.txt, e.mask, e.joint_mask, e.temb, e.mods, e.head
        if idx is not None:
            hidden, txt, temb = hidden[idx], txt[idx], temb[idx]
            mask, joint = (x[idx] if x is not None else None for x in (mask, joint))
            mods = mods[:, :, :, idx] if mods is not None and mods.dim() == 6 else mods
            head = head[:, idx] if head is not None and head.dim() == 4 else head
        if e.stack is not None:
            args = stack_inputs(hidden, txt, joint, mods, e.rope[2], head)
            if self.cuda_graphs:  # a new replay; the output copied out of the graph's memory pool,
                torch.compiler.cudagraph_mark_step_begin()  # which the next replay overwrites
            out = e.stack(*args)  # it calls no module, so dynamo's hook guards have nothing to fail on
            return tuple(x.clone() for x in out) if self.cuda_graphs else out
        flat = None if mods is None else mods.reshape(-1, *mods.shape[3:]).unbind(0)  # 12 views per block
        for i, block in enumerate(self.t.transformer_blocks):
            if flat is not None and self.ops[i] is not None:
                mod = (flat[12 * i : 12 * i + 6], flat[12 * i + 6 : 12 * i + 12])
                hidden, txt = joint_block(self.ops[i], hidden, txt, joint, mod, e.rope[2])
            else:
                txt, hidden = block(
                    hidden_states=hidden,
                    encoder_hidden_states=txt,
                    encoder_hidden_states_mask=mask,
                    temb=temb,
                    image_rotary_emb=e.rope[3],
                    joint_attention_kwargs={},
                    modulate_index=None,
                )
        return hidden, None

    @torch.no_grad()
    def head(self, e: FastEmbedded, hidden: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """``norm_out`` with each row's own (1 + scale, shift), ``proj_out``; the noise tokens."""
        t = self.t
        if e.head is None:
            return t.proj_out(t.norm_out(hidden, e.temb if idx is None else e.temb[idx]))[:, : e.noise_tokens]
        scale, shift = e.head if idx is None or e.head.dim() == 2 else e.head[:, idx]
        norm = t.norm_out.norm
        hidden = F.layer_norm(hidden, norm.normalized_shape, norm.weight, norm.bias, norm.eps) * scale + shift
        return t.proj_out(hidden)[:, : e.noise_tokens]

    def __call__(self, rows: Sequence[Row]) -> torch.Tensor:
        e = self.embed(rows)
        hidden, projected = self.run(e)
        if projected is not None and self.stack_head:
            return projected[:, : e.noise_tokens]  # the compiled stack's head: ``head``'s operators
        return self.head(e, hidden)
