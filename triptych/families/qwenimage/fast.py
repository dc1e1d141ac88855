"""Qwen-Image's step without its per-step overhead: what is constant per request is computed at ``prepare``.

Profiled on the default model (benchmarks/RESULTS.md, "Step overhead"): a transformer forward there is
~960 operators on tensors of a few dozen tokens, so its time is Python and dispatch, not arithmetic.
What is constant per request is computed once, with the transformer's own modules on the shapes
the model's forward would use, so every value has the bits that forward would compute again:

- at ``prepare`` (``FastForward.tables``): the text stream's input ``txt_in(txt_norm(prompt_embeds))``
  of each CFG branch, and of both branches padded and stacked as a fused-CFG forward of the request
  has them (the blocks' text-side projections read the block input and stay in the step);
- at a step's first one-row forward (``step_entry``), kept for the other branch's: the timestep
  embedding, every block's ``img_mod``/``txt_mod`` modulation split into (shift, 1 + scale, gate) as
  ``_modulate`` uses it, and ``norm_out``'s (1 + scale, shift). A forward of several rows computes
  these batched, as the model does, because a matmul over stacked rows does not give the same bits
  as one per row: one matmul for every block's modulation (weights concatenated along the output
  dimension; each output element is the same dot product).

The blocks run ``fast_block``'s kernels: the operators of diffusers' block and attention processor
(native SDPA) without what is constant or redundant: ``Attention.forward``'s per-call
``inspect.signature``, ``dispatch_attention_fn``'s registry look-ups and checks, the joint text+image
key mask rebuilt in every block (built once per forward), the RoPE look-up, module-call overhead.
Nothing reads a tensor's value on the host. Result: the same bits as the model's forward for one row
and for a batch (tests/pipelines/test_step_tables.py; test_qwenimage.py against pristine diffusers).

``usable`` says when it applies; otherwise the family calls the transformer as before: a row with a
LoRA (an adapter may change ``txt_in`` or a modulation linear), ``zero_cond_t`` checkpoints, a
processor or attention backend other than diffusers' native one (sequence parallel, flash),
hooks on the model (a hook expects its forward to run). With ``--compile`` the blocks and the head
run as one compiled graph (``fast_stack.py``) when every block takes ``joint_block``, reading the rows'
temb and modulation from tables of the whole schedule made at ``prepare`` (``schedule``: one batch, not
bit-identical to the model's per-step batch, as the compiled stack is not; ``fast_schedule.py``: where
they fit ``SCHEDULE_BYTES``, else computed per step); otherwise, with compiled
blocks, each block is called as a module, so its compiled graph runs. The fused copies (q/k/v,
modulation) are rebuilt when a weight is replaced or changed in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from triptych.families.base import COND, UNCOND, DenoiseState, Row
from triptych.families.fastpath import model_hooked, native_attention
from triptych.families.qwenimage.denoise import image_shapes, pad_prompts
from triptych.families.qwenimage.fast_block import BlockPlan, joint_block, module_block
from triptych.families.qwenimage.fast_schedule import fits_schedule, from_schedule
from triptych.families.qwenimage.fast_stack import FrozenStack, compile_stack, stack_inputs
from triptych.families.qwenimage.fast_text import batch_text
from triptych.families.qwenimage.fast_watch import Watch, hooked

#: Largest concatenation of every block's modulation weights kept to build a table in one matmul per
#: step (the default model's: 2.7 MB); above it each block's ``img_mod``/``txt_mod`` runs on its own.
FUSED_MOD_BYTES = 64 << 20


@dataclass
class QwenTables:
    """One request's constants (``DenoiseState.step_consts``)."""

    text: dict[str, torch.Tensor]  # branch -> (1, L, dim) after txt_norm/txt_in
    #: both CFG branches as one forward stacks them (cond, uncond): (2, max L, dim) and the bool text
    #: mask (None for equal lengths); None without CFG
    pair: tuple[torch.Tensor, torch.Tensor | None] | None
    #: the current step's one-row (temb, modulation, norm_out's) entry: computed by the first branch's
    #: forward at that step, read by the other's
    step: int = -1
    entry: tuple | None = None
    #: ``--compile`` only: every step's (temb, modulation, norm_out's) for one row, (steps, ...) each,
    #: computed at ``prepare`` in one batch over the schedule (``FastForward.schedule``); None: per step
    schedule: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: the last several-row batch this request led (its first row): (the rows' prompts as weak
    #: references, the text layers' weights and versions, text, mask); ``fast_text.batch_text``
    batch: tuple | None = None


def _mod_linears(t) -> list[torch.nn.Linear]:
    """Every linear that reads ``silu(temb)``, in table order: each block's img_mod, txt_mod; norm_out."""
    return [lin for b in t.transformer_blocks for lin in (b.img_mod[1], b.txt_mod[1])] + [t.norm_out.linear]


def _fusable(linears, idle: frozenset[int]) -> bool:
    if any(hooked(m, idle) for m in linears):
        return False
    ok = all(
        type(m) is torch.nn.Linear and m.bias is not None and type(m.weight) is torch.nn.Parameter for m in linears
    )
    return ok and sum(m.weight.numel() * m.weight.element_size() for m in linears) <= FUSED_MOD_BYTES


@dataclass
class FastEmbedded:
    """``FastForward.embed``'s batch: the block stack's inputs for every row."""

    hidden: torch.Tensor  # (rows, img_seq, dim) after img_in; edit: noise ‖ condition tokens
    txt: torch.Tensor  # (rows, txt_seq, dim) after txt_norm/txt_in, right-padded
    mask: torch.Tensor | None  # (rows, txt_seq) bool, None when every row has the same text length
    joint_mask: torch.Tensor | None  # (rows, 1, 1, txt_seq + img_seq) bool: the attention key mask
    temb: torch.Tensor  # (rows, dim)
    mods: torch.Tensor | None  # (blocks, 2, 6, dim) for one row, (blocks, 2, 6, rows, 1, dim); None: modular
    head: torch.Tensor | None  # norm_out's (1 + scale, shift): (2, dim) or (2, rows, 1, dim)
    rope: tuple  # (img freqs, txt freqs, joint freqs, (img, txt) as the model's pos_embed returns them)
    noise_tokens: int
    #: the compiled block stack the blocks run as (``FastForward.stack``, checked once per forward); None: eager
    stack: FrozenStack | None = None

    @property
    def frozen(self) -> bool:
        return self.stack is not None


def usable(transformer, rows: Sequence[Row]) -> bool:
    """Whether ``forward`` computes what the transformer's own forward would (see the module doc)."""
    t = transformer
    if t.zero_cond_t or model_hooked(t):
        return False  # a hook on the model expects its forward to run
    if any(r.state.params.lora or r.state.step_consts is None for r in rows):
        return False
    for block in transformer.transformer_blocks:
        p = block.attn.processor
        if type(p) is not QwenDoubleStreamAttnProcessor2_0 or not native_attention(p):
            return False
    return True


def _compiled(block) -> bool:
    return getattr(block, "_compiled_call_impl", None) is not None


def _block_hooked(block) -> bool:
    return bool(block._forward_hooks or block._forward_pre_hooks)


class FastForward:
    """``forward`` bound to one transformer, with its RoPE and text-padding values cached per shape."""

    def __init__(self, transformer, vae_scale_factor: int, idle=None, compile_device=None, cuda_graphs=False):
        """``idle()``: ids of forward hooks that add nothing to a forward this class runs (the LoRA
        runtime's: the fast path runs no row with an adapter), so the linears under them may be
        called as ``F.linear``; None = every hook counts. ``compile_device``: ``--compile``'s device,
        to run the blocks as one compiled graph (``fast_stack.py``); None: eager. ``cuda_graphs``:
        that graph replays as CUDA graphs (``--cuda-graphs``)."""
        self.t = transformer
        self.vae_scale_factor = vae_scale_factor
        self.idle = idle or frozenset
        self._rope: dict[tuple, tuple] = {}
        self.plans = [BlockPlan(b) for b in transformer.transformer_blocks]
        self._mod_key: list | None = None
        self._mod: tuple[torch.Tensor, torch.Tensor] | None = None
        self.compile_device = compile_device
        self.cuda_graphs = cuda_graphs
        self._stack: FrozenStack | None = None
        #: the plans' and the stack head's ``Watch`` as of the stack's last ``sync``: one check per forward
        self._watch: Watch | None = None

    def stack(self) -> FrozenStack | None:
        """The compiled block stack when ``--compile`` is on and every block takes ``joint_block``
        (built at the first such forward, its buffers synced to the plans' current copies); else None."""
        if self.compile_device is None:
            return None
        idle = self.idle()
        if self._watch is not None and self._watch.holds(idle):  # nothing changed since the last sync
            return self._stack
        self._watch = None
        if not all(plan.current(idle) for plan in self.plans):
            return None
        if self._stack is None:
            head = (self.t.norm_out.norm, self.t.proj_out)
            self._stack = compile_stack(self.plans, head, self.compile_device, self.cuda_graphs)
        self._stack.sync(self.plans)
        self._watch = Watch.union([*(plan.watch for plan in self.plans), self._stack.head_watch()])
        return self._stack

    def mod_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every modulation linear's weight and bias concatenated (``_mod_linears`` order), rebuilt when
        one is replaced or changed in place or hooked; None when they are not plain or exceed
        ``FUSED_MOD_BYTES``. Checked every forward: one pass over (module, weight, version) records."""
        idle = self.idle()
        key = self._mod_key
        if key is not None:
            for m, w, wv, b, bv, h in key:
                if m.weight is not w or w._version != wv or m.bias is not b or (b is not None and b._version != bv):
                    break
                if hooked(m, idle) != h:
                    break
            else:
                return self._mod
        linears = _mod_linears(self.t)
        self._mod_key = [
            (m, m.weight, m.weight._version, m.bias, None if m.bias is None else m.bias._version, hooked(m, idle))
            for m in linears
        ]
        self._mod = None
        if _fusable(linears, idle):
            self._mod = (
                torch.cat([m.weight for m in linears]).detach(),
                torch.cat([m.bias for m in linears]).detach(),
            )
        return self._mod

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's (shift, 1 + scale, gate) ×2 per stream and ``norm_out``'s (1 + scale, shift) for
        ``temb`` (rows, dim): ((rows, blocks, 2, 6, dim), (rows, 2, dim)). The modulation linears all read
        ``silu(temb)`` (``img_mod``/``txt_mod`` are SiLU then Linear; ``norm_out`` applies its own SiLU
        first), so for several rows this is one matmul against their weights concatenated along the
        output dimension (each output element is the same dot product; bit-identical on CPU, held by
        the exactness tests). One row is a matrix-vector product, whose kernel may sum a dot product
        in another order when the output is 12x longer: on an AVX-512 CPU (AMD Zen 4) the fused
        table was 1.8e-7 off the model's, so one row runs each linear on its own, as the model does."""
        blocks, dim = len(self.t.transformer_blocks), temb.shape[-1]
        fused = self.mod_weights() if temb.shape[0] > 1 else None
        if fused is not None:
            table = F.linear(F.silu(temb), *fused)
        else:
            table = torch.cat([m(F.silu(temb)) for m in _mod_linears(self.t)], dim=-1)
        mods = table[:, : blocks * 12 * dim].reshape(-1, blocks, 2, 2, 3, dim)
        mods[:, :, :, :, 1] += 1  # _modulate's (1 + scale)
        head = table[:, blocks * 12 * dim :].reshape(-1, 2, dim)
        head[:, 0] += 1  # norm_out's (1 + scale)
        return mods.reshape(-1, blocks, 2, 6, dim), head

    @torch.no_grad()
    def tables(self, state: DenoiseState) -> QwenTables:
        """The request's text constants, computed as the model's forward computes them: one branch alone,
        and both branches stacked and padded as a fused-CFG forward of this request does."""
        t = self.t
        branches = state.cond.branches
        text = {b: t.txt_in(t.txt_norm(v["prompt_embeds"])) for b, v in branches.items()}
        pair = None
        if COND in branches and UNCOND in branches:
            embeds, mask = pad_prompts([branches[b]["prompt_embeds"] for b in (COND, UNCOND)])
            pair = (t.txt_in(t.txt_norm(embeds)), mask.to(torch.bool) if mask is not None else None)
        tabled = self.compile_device is not None and fits_schedule(t, len(state.timesteps))
        return QwenTables(text, pair, schedule=self.schedule(state) if tabled else None)

    def schedule(self, state: DenoiseState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temb, modulation, norm_out's) of every step of ``state``'s schedule, one row each: one batch
        of ``len(timesteps)`` rows instead of one per step (the 2.7 MB of modulation weights read once
        per request, not at every step). A matmul over other rows than the model's forward has can
        round differently, so only the compiled stack reads these (``--compile`` is not bit-exact
        anyway: tests/pipelines/test_compile.py holds the tolerance)."""
        dtype = self.t.img_in.weight.dtype
        timesteps = (state.timesteps.to(state.latents.dtype) / 1000).to(dtype)
        temb = self.t.time_text_embed(timesteps, state.latents.new_empty(0, dtype=dtype), None)
        mods, head = self.modulation(temb)
        return temb, mods, head

    def step_entry(self, state: DenoiseState, modular: bool) -> tuple:
        """(temb, modulation, norm_out's) for one row of ``state`` at its step, once per step."""
        tables = state.step_consts
        if tables.step != state.step or tables.entry is None or (tables.entry[1] is None) != modular:
            dtype = self.t.img_in.weight.dtype
            timestep = (state.timestep.expand(1).to(state.latents.dtype) / 1000).to(dtype)
            temb = self.t.time_text_embed(timestep, state.latents.new_empty(0, dtype=dtype), None)
            mods = head = None
            if not modular:  # (blocks, 2, 6, dim) and (2, dim): broadcast over the row and its tokens
                mods, head = self.modulation(temb)
                mods, head = mods[0], head[0]
            tables.step, tables.entry = state.step, (temb, mods, head)
        return tables.entry

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
        t = self.t
        states = [r.state for r in rows]
        one = len(rows) == 1
        latents = states[0].latents if one else torch.cat([s.latents for s in states])
        noise_tokens = latents.shape[1]
        if "image_latents" in states[0].cond.shared:
            image_latents = torch.cat([s.cond.shared["image_latents"] for s in states])
            latents = torch.cat([latents, image_latents], dim=1)
        hidden = t.img_in(latents)
        stack = None if any(_block_hooked(b) for b in t.transformer_blocks) else self.stack()
        modular = stack is None and any(_compiled(b) or _block_hooked(b) for b in t.transformer_blocks)
        mods = head = None
        scheduled = from_schedule(states) if stack is not None else None
        if one:  # the request's tables
            txt, mask = states[0].step_consts.text[rows[0].branch], None
            temb, mods, head = scheduled or self.step_entry(states[0], modular)
        else:  # as the model's forward computes them for these rows, batched (the same bits as it)
            pair = states[0].step_consts.pair
            if (
                len(rows) == 2
                and states[1] is states[0]
                and pair is not None
                and rows[0].branch == COND
                and rows[1].branch == UNCOND
            ):
                txt, mask = pair  # this request's fused CFG rows: its own text constants
            else:
                prompts = [r.state.cond.branches[r.branch]["prompt_embeds"] for r in rows]
                txt, mask = batch_text(t, states[0].step_consts, prompts, self.idle())
            if scheduled is not None:
                temb, mods, head = scheduled
            else:
                timestep = torch.cat([s.timestep.expand(1).to(latents.dtype) for s in states]) / 1000
                temb = t.time_text_embed(timestep.to(hidden.dtype), hidden, None)
            if not modular and scheduled is None:  # (blocks, 2, 6, rows, 1, dim) and (2, rows, 1, dim)
                mods, head = self.modulation(temb)
                mods, head = mods.permute(1, 2, 3, 0, 4).unsqueeze(4), head.permute(1, 0, 2).unsqueeze(2)
        shapes = image_shapes(states[0], self.vae_scale_factor)
        rope = self.rotary(shapes, txt.shape[1], hidden.device)
        if mask is not None:  # the processor's joint (text ‖ image) key mask, once instead of per block
            image_mask = torch.ones((hidden.shape[0], 1, 1, hidden.shape[1]), dtype=torch.bool, device=hidden.device)
            joint = torch.cat([mask[:, None, None], image_mask], dim=-1)
        else:
            joint = None
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
        """``blocks``, and the compiled stack's head output where it ran them (``FrozenStack``), else None."""
        hidden, txt, mask, joint, temb, mods, head = e.hidden, e.txt, e.mask, e.joint_mask, e.temb, e.mods, e.head
        if idx is not None:
            hidden, txt, temb = hidden[idx], txt[idx], temb[idx]
            mask, joint = (x[idx] if x is not None else None for x in (mask, joint))
            mods = mods[:, :, :, idx] if mods is not None and mods.dim() == 6 else mods
            head = head[:, idx] if head is not None and head.dim() == 4 else head
        img_freqs, txt_freqs, joint_freqs, rotary = e.rope
        if mods is None:
            for block in self.t.transformer_blocks:
                txt, hidden = block(
                    hidden_states=hidden,
                    encoder_hidden_states=txt,
                    encoder_hidden_states_mask=mask,
                    temb=temb,
                    image_rotary_emb=rotary,
                    joint_attention_kwargs={},
                    modulate_index=None,
                )
            return hidden, None
        if e.stack is not None:
            args = stack_inputs(hidden, txt, joint, mods, joint_freqs, head)
            if self.cuda_graphs:  # a new replay; the output copied out of the graph's memory pool,
                torch.compiler.cudagraph_mark_step_begin()  # which the next replay overwrites
            out = e.stack(*args)  # it calls no module, so dynamo's hook guards have nothing to fail on
            return tuple(x.clone() for x in out) if self.cuda_graphs else out
        # every block's 12 modulation tensors as views from one unbind (not 3 per block)
        flat, idle = mods.reshape(-1, *mods.shape[3:]).unbind(0), self.idle()
        for i, plan in enumerate(self.plans):
            mod = (flat[12 * i : 12 * i + 6], flat[12 * i + 6 : 12 * i + 12])
            if plan.current(idle):
                hidden, txt = joint_block(plan, hidden, txt, joint, mod, joint_freqs)
            else:
                hidden, txt = module_block(plan.block, hidden, txt, joint, mod, img_freqs, txt_freqs)
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
        if projected is not None and not hooked(self.t.proj_out, self.idle()):
            return projected[:, : e.noise_tokens]  # the compiled stack's head: ``head``'s operators
        return self.head(e, hidden)
