"""One Qwen-Image block with its modulation precomputed (``fast.py``): diffusers 0.42.1's operators, fewer calls.

``QwenImageTransformerBlock.forward`` and ``QwenDoubleStreamAttnProcessor2_0`` (native SDPA backend)
without ``zero_cond_t``, taking the block's modulation as (shift, 1 + scale, gate) tensors instead of
``img_mod(temb)``/``txt_mod(temb)``. Two kernels:

- ``joint_block`` (float32, plain ``nn.Linear`` layers without hooks, RMSNorm q/k norms of one eps):
  q/k/v of each stream as one matmul (weights concatenated along the output dimension: each output
  element is the same dot product); the text and image q/k are joined first and normalised by one
  ``rms_norm`` (no weight) times the per-token weights, then rotated by one complex multiply with the
  joined frequencies (all elementwise on the same values); SDPA reads q/k/v as strided views of that
  tensor. Linear layers are called as ``F.linear`` on their own parameters.
- ``module_block`` otherwise: the processor's operators one by one, every linear called as a module
  (so a hook on it runs).

Each rewrite gives the same bits on CPU as the operators it replaces (measured on torch 2.13; held by
the exactness tests against pristine diffusers, tests/pipelines/test_qwenimage.py and
tests/pipelines/test_step_tables.py). Only ``addcmul`` for the gated residual was not (left as mul + add).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm

from triptych.families.qwenimage.fast_watch import Watch, hooked


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_emb_qwen(x, f, use_real=False)`` with ``f`` already broadcastable to ``x``."""
    if x.dtype == torch.float32:  # .float() and .type_as(x) are then no-ops: not dispatched
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs).flatten(-2)
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_rotated * freqs).flatten(-2).type_as(x)


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``RMSNorm.forward`` off NPUs."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x2 = x * torch.rsqrt(variance + norm.eps)
    if norm.weight is None:
        return x2.to(x.dtype)
    if norm.weight.dtype in (torch.float16, torch.bfloat16):
        x2 = x2.to(norm.weight.dtype)
    x2 = x2 * norm.weight
    return x2 + norm.bias if norm.bias is not None else x2


def _ln(x: torch.Tensor, norm) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, None, None, norm.eps)


def _gated(block, hidden, txt, img_attn, txt_attn, mods, img_mlp, txt_mlp):
    """The block after attention: gated residuals, norm2 + modulation, the MLPs, the fp16 clip."""
    (_, _, ig1, ish2, isc2, ig2), (_, _, tg1, tsh2, tsc2, tg2) = mods
    hidden = hidden + ig1 * img_attn
    txt = txt + tg1 * txt_attn
    hidden = hidden + ig2 * img_mlp(_ln(hidden, block.img_norm2) * isc2 + ish2)
    txt = txt + tg2 * txt_mlp(_ln(txt, block.txt_norm2) * tsc2 + tsh2)
    if txt.dtype == torch.float16:
        txt = txt.clip(-65504, 65504)
    if hidden.dtype == torch.float16:
        hidden = hidden.clip(-65504, 65504)
    return hidden, txt


def module_block(block, hidden, txt, mask, mods, img_freqs, txt_freqs):
    """The block's operators one by one; ``img_freqs``/``txt_freqs`` are (S, 1, D/2) complex."""
    (ish1, isc1, *_), (tsh1, tsc1, *_) = mods
    attn = block.attn
    img = _ln(hidden, block.img_norm1) * isc1 + ish1
    tx = _ln(txt, block.txt_norm1) * tsc1 + tsh1
    seq_txt, head_dim = tx.shape[1], attn.inner_dim // attn.heads
    iq, ik, iv = (p(img).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
    tq, tk, tv = (p(tx).unflatten(-1, (-1, head_dim)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    iq = _rms(attn.norm_q, iq) if attn.norm_q is not None else iq
    ik = _rms(attn.norm_k, ik) if attn.norm_k is not None else ik
    tq = _rms(attn.norm_added_q, tq) if attn.norm_added_q is not None else tq
    tk = _rms(attn.norm_added_k, tk) if attn.norm_added_k is not None else tk
    iq, ik, tq, tk = rope(iq, img_freqs), rope(ik, img_freqs), rope(tq, txt_freqs), rope(tk, txt_freqs)
    q, k, v = (torch.cat(pair, dim=1).permute(0, 2, 1, 3) for pair in ((tq, iq), (tk, ik), (tv, iv)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=None)
    out = out.permute(0, 2, 1, 3).flatten(2, 3).to(q.dtype)
    img_attn = attn.to_out[0](out[:, seq_txt:, :].contiguous())
    txt_attn = attn.to_add_out(out[:, :seq_txt, :].contiguous())

    def mlp(ff):
        act = ff.net[0]
        return lambda x: ff.net[2](F.gelu(act.proj(x), approximate=act.approximate))

    return _gated(block, hidden, txt, img_attn, txt_attn, mods, mlp(block.img_mlp), mlp(block.txt_mlp))


#: ``joint_block``'s eight matrix products (``BlockPlan.operand``): the fused q/k/v of each stream, the
#: attention outputs, the MLPs' two layers
TXT_QKV, IMG_QKV, IMG_OUT, TXT_OUT, IMG_UP, IMG_DOWN, TXT_UP, TXT_DOWN = range(8)


def own_operand(linears, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of product ``k`` >= ``IMG_OUT``: the block's own linear (``BlockPlan.linears`` order)."""
    linear = linears[4 + k]
    return linear.weight, linear.bias


class BlockPlan:
    """One block's operands for ``joint_block``, resolved once and rebuilt when a weight is replaced,
    changed in place or hooked (``current``); ``joint`` says whether that kernel applies."""

    def __init__(self, block):
        a = block.attn
        self.block = block
        self.qkv = ((a.add_q_proj, a.add_k_proj, a.add_v_proj), (a.to_q, a.to_k, a.to_v))  # text, image
        self.linears = (
            *self.qkv[0],
            *self.qkv[1],
            a.to_out[0],
            a.to_add_out,
            block.img_mlp.net[0].proj,
            block.img_mlp.net[2],
            block.txt_mlp.net[0].proj,
            block.txt_mlp.net[2],
        )
        self.norms = (a.norm_added_q, a.norm_added_k, a.norm_q, a.norm_k)  # text q, k; image q, k
        self.head_dim = a.inner_dim // a.heads
        self.approximate = (block.img_mlp.net[0].approximate, block.txt_mlp.net[0].approximate)
        self.watch: Watch | None = None
        self.joint = False
        self._weights: dict[tuple[int, int], torch.Tensor] = {}

    def _eligible(self, idle: frozenset[int]) -> bool:
        if any(hooked(m, idle) or type(m) is not torch.nn.Linear for m in self.linears):
            return False
        if any(type(m.weight) is not torch.nn.Parameter or m.weight.dtype != torch.float32 for m in self.linears):
            return False
        if any(m.bias is None for side in self.qkv for m in side):
            return False
        norms = self.norms
        if any(type(n) is not RMSNorm or n.weight is None or n.bias is not None for n in norms):
            return False
        return all(n.weight.dtype == torch.float32 and n.eps == norms[0].eps for n in norms)

    def current(self, idle: frozenset[int] = frozenset()) -> bool:
        """Whether ``joint_block`` applies (rebuilding the copies first if needed); ``idle``: ids of
        forward hooks known to add nothing to this forward (``hooked``)."""
        if self.watch is not None and self.watch.holds(idle):
            return self.joint
        self.joint, self._weights = self._eligible(idle), {}
        owners = [(m, "weight") for m in self.linears] + [(m, "bias") for m in self.linears]
        owners += [(n, "weight") for n in self.norms if isinstance(getattr(n, "weight", None), torch.nn.Parameter)]
        # what the copies below are made from (or what made the block ineligible); none where a hook
        # did, since a watch fails on a hook added, not on one removed: checked again at every call
        # until the hook is gone, then the kernel is back
        unhooked = not any(hooked(m, idle) for m in self.linears)
        self.watch = Watch.of(self.linears, owners) if self.joint or unhooked else None
        if self.joint:
            self.fused = [
                (torch.cat([m.weight for m in s]).detach(), torch.cat([m.bias for m in s]).detach()) for s in self.qkv
            ]
            self.eps = self.norms[0].eps
            w = [n.weight.detach() for n in self.norms]
            self._qk = (torch.stack(w[:2])[:, None], torch.stack(w[2:])[:, None])  # (2, 1, head_dim) each
        return self.joint

    def operand(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of ``joint_block``'s product ``k`` (``TXT_QKV`` ... ``TXT_DOWN``): the fused
        q/k/v copies, else the block's own linear."""
        return self.fused[k] if k < IMG_OUT else own_operand(self.linears, k)

    def product(self, k: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, *self.operand(k))

    @staticmethod
    def attend(q, k, v, mask) -> torch.Tensor:
        """The processor's attention (native SDPA backend)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=None)

    @staticmethod
    def act(x: torch.Tensor, approximate: str) -> torch.Tensor:
        """The MLP's activation (``GELU``'s)."""
        return F.gelu(x, approximate=approximate)

    def norm_weight(self, text: int, image: int) -> torch.Tensor:
        """The q/k norm weights of every joint token: (text + image, 2, 1, head_dim)."""
        key = (text, image)
        if key not in self._weights:
            txt, img = self._qk
            self._weights[key] = torch.cat([txt.expand(text, -1, -1, -1), img.expand(image, -1, -1, -1)])
        return self._weights[key]


def joint_block(plan: BlockPlan, hidden, txt, mask, mods, joint_freqs):
    """``module_block`` for a plan whose ``current()`` is True; ``joint_freqs``: (L + S, 1, 1, D/2) complex."""
    block = plan.block
    (ish1, isc1, *_), (tsh1, tsc1, *_) = mods
    img = _ln(hidden, block.img_norm1) * isc1 + ish1
    tx = _ln(txt, block.txt_norm1) * tsc1 + tsh1
    seq_txt, head_dim = tx.shape[1], plan.head_dim
    joint = torch.cat(
        [
            plan.product(TXT_QKV, tx).unflatten(-1, (3, -1, head_dim)),
            plan.product(IMG_QKV, img).unflatten(-1, (3, -1, head_dim)),
        ],
        dim=1,
    )  # (B, L + S, 3 (q, k, v), heads, head_dim)
    qk = F.rms_norm(joint[:, :, :2], (head_dim,), None, plan.eps) * plan.norm_weight(seq_txt, img.shape[1])
    q, k = rope(qk, joint_freqs).permute(2, 0, 3, 1, 4).unbind(0)
    v = joint[:, :, 2].permute(0, 2, 1, 3)
    out = plan.attend(q, k, v, mask).permute(0, 2, 1, 3).flatten(2, 3)
    img_attn = plan.product(IMG_OUT, out[:, seq_txt:, :].contiguous())
    txt_attn = plan.product(TXT_OUT, out[:, :seq_txt, :].contiguous())
    ia, ta = plan.approximate

    def img_mlp(x):
        return plan.product(IMG_DOWN, plan.act(plan.product(IMG_UP, x), ia))

    def txt_mlp(x):
        return plan.product(TXT_DOWN, plan.act(plan.product(TXT_UP, x), ta))

    return _gated(block, hidden, txt, img_attn, txt_attn, mods, img_mlp, txt_mlp)
