"""``--compile`` on Qwen-Image's fast path runs the block stack and the head as one compiled graph
(``families/qwenimage/fast_stack.py``), and a weight *replaced* after the compile
is seen: the fused q/k/v copies are rebuilt and the stack's buffers repointed, or its arena rebuilt
(``FrozenStack.load``). Without ``load`` (the copies a plain function would close over) the compiled
graph kept the old weights: a scratch check on torch 2.13 gave the old output after a replaced tensor.

A weight changed *in place* is seen too: the copies are rebuilt (``fastpath.Stamp`` checks every
linear's versions, the head's ``proj_out`` too: the fused q/k/v, and on CPU the transposed copy of
every product), and without an arena the parameters the stack reads directly are graph inputs, not
constants.

Forward hooks added after the compile to the linears the stack reads (as ``lora/rows.py`` attaches an
adapter loaded at run time; idle for rows without one) compile no new graph: the stack reads the
linears' weights and never calls them, so dynamo has no hook to guard on (``fast.py`` calls the stack
without patching its ``skip_nnmodule_hook_guards``, which ``accel/compile.py`` turns off; the patch cost
~80 us a call). The same hooks not idle take the stack out of the forward (a hook must run), and once
removed the stack is back (the stamp keeps each hook's verdict: a block left ineligible by a hook is
not left so until a weight changes).

A request whose schedule tables would exceed ``fast.SCHEDULE_BYTES`` has none and the stack
reads each step's modulation computed at that step (2.38e-7 from eager here, as with the tables).

Both forms of the stack: its operands in one arena (what the tiny and the default model get) and as
separate buffers (``ARENA_BYTES`` = 0 here: what a model above the arena's size gets).

Tiny seeded Qwen-Image, CPU, one request's fused-CFG rows; compiled vs eager forward measured at most
1.91e-6 max abs, in both forms (before the changes 2.4e-7, after the replacement 1.91e-6: the head's
replaced weight makes the outputs ~10x larger; after the in-place change 1.43e-6), tolerance 7.5x that.
"""

from __future__ import annotations

import pytest
import torch

from triptych.accel import SpeedConfig
from triptych.accel.compile import compile_counts
from triptych.families.base import GenerationParams, Row
from triptych.families.qwenimage import fast, fast_stack
from triptych.families.registry import load_family

TOLERANCE = 1.4e-5  # measured 1.91e-6


@pytest.fixture(params=["arena", "buffers"])
def families(request, tiny_model_dir, inductor_cache_dir, monkeypatch):
    if request.param == "buffers":
        monkeypatch.setattr(fast_stack, "ARENA_BYTES", 0)
    path = tiny_model_dir("qwen-image")
    speed = SpeedConfig(compile=True, compile_cache_dir=inductor_cache_dir)
    return request.param, load_family(path), load_family(path, speed=speed)


def rows_of(family):
    params = family.resolve(GenerationParams(prompt="a red circle", negative_prompt="blue", seed=1, steps=4))
    state = family.prepare("r", params, family.encode(params))
    return [Row(state, b) for b in state.branches()]


def replace(family, generator) -> None:
    """New parameter objects (other values) for one fused linear, two the stack reads directly, the head's."""
    block = family.pipe.transformer.transformer_blocks[0]
    for linear in (block.attn.to_q, block.attn.to_out[0], block.img_mlp.net[2], family.pipe.transformer.proj_out):
        new = linear.weight.detach() + 0.5 * torch.randn(linear.weight.shape, generator=generator)
        linear.weight = torch.nn.Parameter(new)


def test_the_stack_runs_compiled_and_sees_replaced_weights(families, monkeypatch):
    form, eager, compiled = families
    rows_e, rows_c = rows_of(eager), rows_of(compiled)
    with torch.no_grad():
        before = compiled.forward(rows_c)
        assert rows_c[0].state.step_consts.schedule is not None  # every step's modulation, at prepare
        monkeypatch.setattr(fast, "SCHEDULE_BYTES", 0)  # a schedule too large to keep: per step
        rows_p = rows_of(compiled)
        assert rows_p[0].state.step_consts.schedule is None
        per_step = compiled.forward(rows_p)
        assert compiled._fast.embed(rows_p).frozen
        assert compiled._fast.embed(rows_c).frozen  # the blocks ran as the compiled stack
        assert compiled._fast._stack._compiled_call_impl is not None
        assert (compiled._fast._stack.arena is not None) == (form == "arena")
        counts = compile_counts()
        linears = [m for m in compiled.pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
        hooks = [m.register_forward_hook(lambda *a: None) for m in linears]
        compiled._fast.idle = lambda: frozenset(h.id for h in hooks)  # as the LoRA runtime's (``hook_ids``)
        assert torch.equal(compiled.forward(rows_c), before) and compiled._fast.embed(rows_c).frozen
        assert compile_counts() == counts  # no graph for the hooks
        compiled._fast.idle = frozenset  # the same hooks, not idle: a linear's hook must run, so no stack
        assert not compiled._fast.embed(rows_c).frozen
        for h in hooks:
            h.remove()
        assert compiled._fast.embed(rows_c).frozen
        assert not eager._fast.embed(rows_e).frozen
        first = float((before - eager.forward(rows_e)).abs().max())
        unscheduled = float((per_step - eager.forward(rows_e)).abs().max())
        for family in (eager, compiled):
            replace(family, torch.Generator().manual_seed(7))
        after_e, after_c = eager.forward(rows_e), compiled.forward(rows_c)
        for family in (eager, compiled):  # and changed in place: a fused one, one read directly, the head's
            block = family.pipe.transformer.transformer_blocks[1]
            for linear in (block.attn.add_k_proj, block.txt_mlp.net[0].proj):
                linear.weight.mul_(-1.5)
            family.pipe.transformer.proj_out.bias.add_(0.25)
        inplace_e, inplace_c = eager.forward(rows_e), compiled.forward(rows_c)
    changed = float((after_e - before).abs().max())
    moved = float((inplace_e - after_e).abs().max())
    second = float((after_c - after_e).abs().max())
    third = float((inplace_c - inplace_e).abs().max())
    print(
        f"{form}: compiled vs eager: {first:.2e} before ({unscheduled:.2e} without schedule tables), {second:.2e} after the replacement (which moved it {changed:.2e}), "
        f"{third:.2e} after the in-place change (which moved it {moved:.2e})"
    )
    assert changed > 100 * TOLERANCE and moved > 100 * TOLERANCE  # the changes matter
    assert unscheduled <= TOLERANCE, f"without the schedule tables: {unscheduled:.2e}"
    assert first <= TOLERANCE and second <= TOLERANCE and third <= TOLERANCE
