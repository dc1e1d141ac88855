"""``--compile`` on Qwen-Image's fast path: the whole block stack as one inductor graph.

The regional compile (``accel/compile.py``) compiles each block as a module; on the fast path
(``fast.py``) that was slower than the eager ``joint_block`` kernel on CPU (benchmarks/RESULTS.md,
"--compile and --quantize"): at a few dozen tokens the step is call overhead, and a compiled block is
still one guarded call per block. Here the six ``joint_block`` calls are one graph
(``nn.Module.compile``, ``dynamic=True``: the batch and sequence sizes symbolic from the first
compile, as the regional blocks). On CPU it compiles with ``cpp_wrapper`` (the graph's calls are made
from C++, not Python; ``accel/compile.CPU_OPTIONS``); on other devices with the default options.

The operands live on this module so that dynamo sees them as module state (graph inputs, not
constants): the fused q/k/v copies and q/k norm weights as buffers, the block (its linears) as a
submodule. The fused copies are copies, so ``sync`` replaces the buffers whenever
``BlockPlan.current`` rebuilt them after a weight was replaced or changed in place (held by
tests/pipelines/test_compile_stack.py); nothing in Triptych changes a transformer weight after load
(LoRA adds its deltas in hooks; rows with an adapter do not take the fast path).
"""

from __future__ import annotations

import torch

from triptych.accel.compile import options_for
from triptych.families.qwenimage.fast_block import BlockPlan, joint_block


class FrozenBlock(torch.nn.Module):
    """One block's ``joint_block`` operands as module state (what ``joint_block`` reads of a plan)."""

    def __init__(self, plan: BlockPlan):
        super().__init__()
        self.block = plan.block
        self.linears = plan.linears  # the block's own linears (submodules of ``block``)
        self.head_dim, self.approximate = plan.head_dim, plan.approximate
        for name in ("wt", "bt", "wi", "bi", "qk_txt", "qk_img"):
            self.register_buffer(name, None, persistent=False)
        self.sync(plan)

    def sync(self, plan: BlockPlan) -> None:
        """Point the buffers at the plan's current copies (replaced, never changed in place)."""
        (wt, bt), (wi, bi) = plan.fused
        if self.wt is not wt or self.wi is not wi or self.qk_txt is not plan._qk[0]:
            self.wt, self.bt, self.wi, self.bi = wt, bt, wi, bi
            self.qk_txt, self.qk_img = plan._qk
        self.eps = plan.eps

    @property
    def fused(self):
        return (self.wt, self.bt), (self.wi, self.bi)

    def norm_weight(self, text: int, image: int) -> torch.Tensor:
        """``BlockPlan.norm_weight`` without its cache (sizes are symbolic in the graph)."""
        return torch.cat([self.qk_txt.expand(text, -1, -1, -1), self.qk_img.expand(image, -1, -1, -1)])


class FrozenStack(torch.nn.Module):
    """Every block's ``joint_block`` in one forward; compiled by ``compile_stack``."""

    def __init__(self, plans: list[BlockPlan]):
        super().__init__()
        self.frozen = torch.nn.ModuleList(FrozenBlock(p) for p in plans)

    def sync(self, plans: list[BlockPlan]) -> None:
        for block, plan in zip(self.frozen, plans):
            block.sync(plan)

    def forward(self, hidden, txt, mask, mods, joint_freqs):
        flat = mods.reshape(-1, *mods.shape[3:]).unbind(0)
        for i, block in enumerate(self.frozen):
            mod = (flat[12 * i : 12 * i + 6], flat[12 * i + 6 : 12 * i + 12])
            hidden, txt = joint_block(block, hidden, txt, mask, mod, joint_freqs)
        return hidden


def stack_inputs(hidden, txt, mask, mods, joint_freqs) -> tuple:
    """The stack's arguments in one form for every call, so that a mixed load compiles two graphs
    (one row, where dynamo specialises the size 1, and several rows) instead of five: a one-row
    modulation table (blocks, 2, 6, dim) as (blocks, 2, 6, 1, 1, dim), the same broadcast over the
    row's tokens; no text mask as an all-True key mask (every key attended, as without one); every
    tensor contiguous and its own, not a view: dynamo guards on a view input's base, so a graph traced
    with a view (a step's row of the schedule tables) failed its guards on a tensor that is none
    (TeaCache's indexed sub-batches) and compiled another. Counted by tests/pipelines/test_compile.py."""
    if mods.dim() == 4:
        mods = mods[:, :, :, None, None]
    if mask is None:
        mask = hidden.new_ones((hidden.shape[0], 1, 1, txt.shape[1] + hidden.shape[1]), dtype=torch.bool)
    return tuple(_own(x) for x in (hidden, txt, mask, mods, joint_freqs))


def _own(x: torch.Tensor) -> torch.Tensor:
    return x if x._base is None and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def compile_stack(plans: list[BlockPlan], device: torch.device | str, cuda_graphs: bool = False) -> FrozenStack:
    """A ``FrozenStack`` over ``plans`` (each ``current()``), compiled for ``device``; ``cuda_graphs``
    (a CUDA device): with torch.compile's ``reduce-overhead`` mode, whose CUDA graph trees record one
    graph per input shape and replay it (the caller marks each call a new step and copies the
    output out of the graphs' pool: ``FastForward.blocks``)."""
    stack = FrozenStack(plans)
    if cuda_graphs:
        stack.compile(dynamic=True, mode="reduce-overhead")
    else:
        stack.compile(dynamic=True, options=options_for(device))
    return stack
