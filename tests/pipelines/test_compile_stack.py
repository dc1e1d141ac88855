"""``--compile`` on Qwen-Image's fast path runs the block stack as one compiled graph
(``families/qwenimage/fast_stack.py``), and a weight *replaced* after the compile
is seen: the fused q/k/v copies are rebuilt and the stack's buffers repointed (``FrozenStack.sync``),
the blocks' own linears are read as module parameters. Without ``sync`` (the copies a plain function
would close over) the compiled graph kept the old weights: a scratch check on torch 2.13 gave the old
output after a replaced tensor.

A weight changed *in place* is seen too: the copies are rebuilt (``BlockPlan.current`` checks every
linear's versions: the fused q/k/v, and on CPU the transposed copy of every product, ``FrozenBlock.sync``)
and the biases the stack reads directly are graph inputs, not constants.

Tiny seeded Qwen-Image, CPU, one request's fused-CFG rows; compiled vs eager forward measured at most
4.8e-7 max abs (before the changes, after the replacement, after the in-place change; two runs, one
before the compiled path read the schedule tables, ``fast.py``), tolerance 7.5x that.
"""

from __future__ import annotations

import pytest
import torch

from triptych.accel import SpeedConfig
from triptych.families.base import GenerationParams, Row
from triptych.families.registry import load_family

TOLERANCE = 3.6e-6  # measured 3.6e-7


@pytest.fixture(scope="module")
def families(tiny_model_dir, tmp_path_factory):
    path = tiny_model_dir("qwen-image")
    speed = SpeedConfig(compile=True, compile_cache_dir=tmp_path_factory.mktemp("inductor"))
    return load_family(path), load_family(path, speed=speed)


def rows_of(family):
    params = family.resolve(GenerationParams(prompt="a red circle", negative_prompt="blue", seed=1, steps=4))
    state = family.prepare("r", params, family.encode(params))
    return [Row(state, b) for b in state.branches()]


def replace(family, generator) -> None:
    """New parameter objects (other values) for one fused linear and two the stack reads directly."""
    block = family.pipe.transformer.transformer_blocks[0]
    for linear in (block.attn.to_q, block.attn.to_out[0], block.img_mlp.net[2]):
        new = linear.weight.detach() + 0.5 * torch.randn(linear.weight.shape, generator=generator)
        linear.weight = torch.nn.Parameter(new)


def test_the_stack_runs_compiled_and_sees_replaced_weights(families):
    eager, compiled = families
    rows_e, rows_c = rows_of(eager), rows_of(compiled)
    with torch.no_grad():
        before = compiled.forward(rows_c)
        assert compiled._fast.embed(rows_c).frozen  # the blocks ran as the compiled stack
        assert compiled._fast._stack._compiled_call_impl is not None
        assert not eager._fast.embed(rows_e).frozen
        first = float((before - eager.forward(rows_e)).abs().max())
        for family in (eager, compiled):
            replace(family, torch.Generator().manual_seed(7))
        after_e, after_c = eager.forward(rows_e), compiled.forward(rows_c)
        for family in (eager, compiled):  # and changed in place: a fused one and one read directly
            block = family.pipe.transformer.transformer_blocks[1]
            for linear in (block.attn.add_k_proj, block.txt_mlp.net[0].proj):
                linear.weight.mul_(-1.5)
        inplace_e, inplace_c = eager.forward(rows_e), compiled.forward(rows_c)
    changed = float((after_e - before).abs().max())
    moved = float((inplace_e - after_e).abs().max())
    second = float((after_c - after_e).abs().max())
    third = float((inplace_c - inplace_e).abs().max())
    print(
        f"compiled vs eager: {first:.2e} before, {second:.2e} after the replacement (which moved it {changed:.2e}), "
        f"{third:.2e} after the in-place change (which moved it {moved:.2e})"
    )
    assert changed > 100 * TOLERANCE and moved > 100 * TOLERANCE  # the changes matter
    assert first <= TOLERANCE and second <= TOLERANCE and third <= TOLERANCE
