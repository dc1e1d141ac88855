"""The compiled CPU stack's own forms of attention and GELU (``families/qwenimage/fast_block.py``) compute
the same functions as the operators they replace: SDPA with a key mask (a masked key gets no weight)
and without one, tanh-GELU over a wide range of inputs (exact GELU is passed through).

Measured (torch 2.13 CPU): attention 4.8e-7 max abs with a mask, 7.2e-7 without (outputs up to 1.4);
GELU 4.8e-7 over [-30, 30]. Tolerances 10x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triptych.families.qwenimage.fast_block import cpu_act, cpu_attend

ATTENTION_TOLERANCE = 7.2e-6  # measured 7.2e-7
GELU_TOLERANCE = 4.8e-6  # measured 4.8e-7


def qkv(generator):
    return tuple(torch.randn(4, 3, 28, 32, generator=generator) for _ in range(3))


def test_cpu_attention_is_sdpa_with_and_without_a_key_mask():
    q, k, v = qkv(torch.Generator().manual_seed(0))
    mask = torch.ones(4, 1, 1, 28, dtype=torch.bool)
    mask[1, ..., 3:9] = False
    mask[3, ..., :5] = False
    masked = cpu_attend(q, k, v, mask, 32**-0.5)
    assert float((masked - F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).abs().max()) <= ATTENTION_TOLERANCE
    plain = cpu_attend(q, k, v, None, 32**-0.5)
    assert float((plain - F.scaled_dot_product_attention(q, k, v)).abs().max()) <= ATTENTION_TOLERANCE
    assert float((plain - masked).abs().max()) > 100 * ATTENTION_TOLERANCE  # the mask matters here
    moved = v.clone()
    moved[1, :, 3:9] += 100.0  # values of masked keys only
    assert torch.equal(cpu_attend(q, k, moved, mask, 32**-0.5), masked)


def test_cpu_gelu_is_tanh_gelu_and_passes_exact_gelu_through():
    x = torch.linspace(-30.0, 30.0, 200_001)
    assert float((cpu_act(x, "tanh") - F.gelu(x, approximate="tanh")).abs().max()) <= GELU_TOLERANCE
    assert torch.equal(cpu_act(x, "none"), F.gelu(x))
