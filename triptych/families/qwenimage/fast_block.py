"""One Qwen-Image block with its modulation precomputed (``fast.py``): diffusers 0.42.1's operators, fewer calls.

``joint_block`` is ``QwenImageTransformerBlock.forward`` and ``QwenDoubleStreamAttnProcessor2_0``
(native SDPA backend) without ``zero_cond_t``, taking the block's modulation as (shift, 1 + scale,
gate) tensors instead of ``img_mod(temb)``/``txt_mod(temb)``, on a block's ``Operands``: q/k/v of each
stream as one matmul (weights concatenated along the output dimension: each output element is the
same dot product); the text and image q/k joined, normalised by one ``rms_norm`` (no weight) times
the per-token weights and rotated by one complex multiply with the joined frequencies (elementwise
on the same values); SDPA on strided views; every linear as ``F.linear`` on its weights. The same
bits on CPU as the operators it replaces (tests/pipelines/test_qwenimage.py against pristine
diffusers, test_step_tables.py); ``addcmul`` for the gated residual was not (left as mul + add).

``operands`` says where it applies (float32 ``nn.Linear`` layers without hooks, q/k/v with biases,
weighted RMSNorm q/k norms of one eps); a block it refuses runs as its module. With ``cpu=True``
(the compiled CPU stack, ``fast_stack.py``) three things take forms inductor's CPU code runs faster
at a few dozen tokens, the same functions with other rounding (tests/unit/test_fast_stack_forms.py):
attention as ``baddbmm`` + softmax + ``bmm`` (``cpu_attend``), tanh-GELU as ``x * sigmoid(2u)``
(``cpu_act``), and products against a transposed copy of the weight (``Operands.transposed``), the
bias added by the next elementwise kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm

from triptych.families.fastpath import hooked

#: ``2 * sqrt(2 / pi)``: tanh-GELU's ``0.5 * x * (1 + tanh(u))`` is ``x * sigmoid(2 * u)``
_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)


def linears(block) -> tuple[torch.nn.Module, ...]:
    """The block's linears in product order: text q/k/v, image q/k/v, image out, text out, image MLP
    up/down, text MLP up/down (``Operands.weights`` fuses the first six into two products)."""
    a = block.attn
    return (
        *(a.add_q_proj, a.add_k_proj, a.add_v_proj, a.to_q, a.to_k, a.to_v, a.to_out[0], a.to_add_out),
        *(block.img_mlp.net[0].proj, block.img_mlp.net[2], block.txt_mlp.net[0].proj, block.txt_mlp.net[2]),
    )


def norms(block) -> tuple[torch.nn.Module, ...]:
    a = block.attn
    return a.norm_added_q, a.norm_added_k, a.norm_q, a.norm_k  # text q, k; image q, k


class Operands:
    """What ``joint_block`` reads of one block: 8 products' (weight, bias) (text q/k/v fused, image
    q/k/v fused, image out, text out, image MLP up/down, text MLP up/down), each weight (in, out)
    where ``transposed``; the q/k norm weights (2, 1, head_dim) of text and image; constants."""

    def __init__(self, weights, biases, transposed, qk, consts, cache: dict | None = None):
        self.weights, self.biases, self.transposed, self.qk = weights, biases, transposed, qk
        self.head_dim, self.eps, self.ln_eps, self.approximate = consts
        self.cache = cache  # (text, image) -> the joint norm weight; None: built every call (in a graph)

    def product(self, k: int, x: torch.Tensor, cpu: bool) -> torch.Tensor:
        w, b = self.weights[k], self.biases[k]
        if not cpu:
            return F.linear(x, w, b)
        out = x @ w if self.transposed[k] else F.linear(x, w)
        return out if b is None else out + b

    def norm_weight(self, text: int, image: int) -> torch.Tensor:
        """The q/k norm weights of every joint token: (text + image, 2, 1, head_dim)."""
        if self.cache is not None and (text, image) in self.cache:
            return self.cache[(text, image)]
        weight = torch.cat([self.qk[0].expand(text, -1, -1, -1), self.qk[1].expand(image, -1, -1, -1)])
        if self.cache is not None:
            self.cache[(text, image)] = weight
        return weight


def operands(block, idle: frozenset[int]) -> Operands | None:
    """``block``'s eager ``Operands`` (fused q/k/v copies, its own other weights), or None where
    ``joint_block`` does not apply (the module doc); ``idle``: forward hooks that add nothing."""
    lin, nrm = linears(block), norms(block)
    if hooked(block, idle) or any(hooked(m, idle) or type(m) is not torch.nn.Linear for m in lin):
        return None
    if any(type(m.weight) is not torch.nn.Parameter or m.weight.dtype != torch.float32 for m in lin):
        return None
    if any(m.bias is None for m in lin[:6]):
        return None
    if any(type(n) is not RMSNorm or n.weight is None or n.bias is not None for n in nrm):
        return None
    if not all(n.weight.dtype == torch.float32 and n.eps == nrm[0].eps for n in nrm):
        return None
    fused = [torch.cat([m.weight for m in side]).detach() for side in (lin[:3], lin[3:6])]
    weights = fused + [m.weight.detach() for m in lin[6:]]
    biases = [torch.cat([m.bias for m in side]).detach() for side in (lin[:3], lin[3:6])]
    biases += [None if m.bias is None else m.bias.detach() for m in lin[6:]]
    qk = tuple(torch.stack([nrm[i].weight.detach(), nrm[i + 1].weight.detach()])[:, None] for i in (0, 2))
    ln_eps = tuple(n.eps for n in (block.img_norm1, block.txt_norm1, block.img_norm2, block.txt_norm2))
    approximate = (block.img_mlp.net[0].approximate, block.txt_mlp.net[0].approximate)
    consts = (block.attn.inner_dim // block.attn.heads, nrm[0].eps, ln_eps, approximate)
    return Operands(weights, biases, (False,) * 8, qk, consts, cache={})


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_emb_qwen(x, f, use_real=False)`` on float32 ``x``, ``f`` broadcastable to it."""
    return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs).flatten(-2)


def cpu_act(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``GELU`` for inductor's CPU code: the tanh form as ``x * sigmoid(2u)`` (the same function; one
    vectorised exp where inductor's tanh costs about twice the MLP's other elementwise work)."""
    if approximate != "tanh":
        return F.gelu(x, approximate=approximate)
    return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x)))


def cpu_attend(q, k, v, mask, scale: float) -> torch.Tensor:
    """SDPA for inductor's CPU code at a few dozen tokens: the scores of every (row, head) as one
    ``baddbmm`` with the key mask as an additive bias, a fused softmax, one ``bmm`` (ATen's CPU flash
    kernel pays a fixed cost per (row, head) that dominates at these sizes). ``mask``: boolean, True
    where a key is attended (SDPA's boolean mask), or None."""
    b, h, n, d = q.shape
    keys = k.shape[2]
    q3, k3, v3 = q.reshape(b * h, n, d), k.reshape(b * h, keys, d), v.reshape(b * h, keys, d)
    if mask is None:
        scores = torch.bmm(q3, k3.transpose(1, 2)) * scale
    else:
        bias = torch.where(mask, 0.0, float("-inf")).to(q.dtype).expand(b, h, n, keys).reshape(b * h, n, keys)
        scores = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(-1), v3).view(b, h, n, d)


def joint_block(p: Operands, hidden, txt, mask, mods, joint_freqs, cpu: bool = False):
    """The block on (image, text) streams; ``mask``: the joint key mask or None; ``mods``: each
    stream's six (shift, 1 + scale, gate) ×2; ``joint_freqs``: (L + S, 1, 1, D/2) complex."""
    (ish1, isc1, ig1, ish2, isc2, ig2), (tsh1, tsc1, tg1, tsh2, tsc2, tg2) = mods
    e1, e2, e3, e4 = p.ln_eps
    img = F.layer_norm(hidden, hidden.shape[-1:], None, None, e1) * isc1 + ish1
    tx = F.layer_norm(txt, txt.shape[-1:], None, None, e2) * tsc1 + tsh1
    seq_txt, head_dim = tx.shape[1], p.head_dim
    joint = torch.cat(
        [
            p.product(0, tx, cpu).unflatten(-1, (3, -1, head_dim)),
            p.product(1, img, cpu).unflatten(-1, (3, -1, head_dim)),
        ],
        dim=1,
    )  # (B, L + S, 3 (q, k, v), heads, head_dim)
    qk = F.rms_norm(joint[:, :, :2], (head_dim,), None, p.eps) * p.norm_weight(seq_txt, img.shape[1])
    q, k = rope(qk, joint_freqs).permute(2, 0, 3, 1, 4).unbind(0)
    v = joint[:, :, 2].permute(0, 2, 1, 3)
    if cpu:
        out = cpu_attend(q, k, v, mask, head_dim**-0.5)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=None)
    out = out.permute(0, 2, 1, 3).flatten(2, 3)
    hidden = hidden + ig1 * p.product(2, out[:, seq_txt:, :].contiguous(), cpu)
    txt = txt + tg1 * p.product(3, out[:, :seq_txt, :].contiguous(), cpu)
    act = cpu_act if cpu else lambda x, approximate: F.gelu(x, approximate=approximate)
    up = F.layer_norm(hidden, hidden.shape[-1:], None, None, e3) * isc2 + ish2
    hidden = hidden + ig2 * p.product(5, act(p.product(4, up, cpu), p.approximate[0]), cpu)
    up = F.layer_norm(txt, txt.shape[-1:], None, None, e4) * tsc2 + tsh2
    txt = txt + tg2 * p.product(7, act(p.product(6, up, cpu), p.approximate[1]), cpu)
    return hidden, txt
