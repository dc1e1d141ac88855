"""``--compile`` on Qwen-Image's fast path: the whole block stack as one inductor graph.

The regional compile (``accel/compile.py``) compiles each block as a module; on the fast path
(``fast.py``) that was slower than the eager ``joint_block`` kernel on CPU (benchmarks/RESULTS.md,
"--compile and --quantize"): at a few dozen tokens the step is call overhead, and a compiled block is
still one guarded call per block. Here the six ``joint_block`` calls are one graph
(``nn.Module.compile``, ``dynamic=True``: the batch and sequence sizes symbolic from the first
compile, as the regional blocks). On CPU it compiles with ``cpp_wrapper`` (the graph's calls are made
from C++, not Python; ``accel/compile.CPU_OPTIONS``); on other devices with the default options.

On CPU the stack also computes three things in forms that inductor's CPU code runs faster at a few
dozen tokens (same functions, other rounding; within the tolerances of tests/pipelines/test_compile.py
and test_compile_stack.py): attention as ``baddbmm`` + softmax + ``bmm`` (``cpu_attend``), tanh-GELU
as ``x * sigmoid(2u)`` (``cpu_act``), and every product against a transposed copy of its weight with
the bias added in the next elementwise kernel (``FrozenBlock.product``). Measured on the default
model, one thread (benchmarks/RESULTS.md): the stack 2.26 -> 1.67 ms at 2 rows, 10.2 -> 7.5 ms at 16.

The operands live on this module so that dynamo sees them as module state (graph inputs, not
constants): the fused q/k/v copies, the transposed copies and q/k norm weights as buffers, the block
(its linears) as a submodule. The copies are copies, so ``sync`` replaces the buffers whenever
``BlockPlan.current`` rebuilt them after a weight was replaced or changed in place (held by
tests/pipelines/test_compile_stack.py); nothing in Triptych changes a transformer weight after load
(LoRA adds its deltas in hooks; rows with an adapter do not take the fast path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from triptych.accel.compile import options_for
from triptych.families.qwenimage.fast_block import IMG_QKV, TXT_QKV, BlockPlan, joint_block, own_operand

#: ``2 * sqrt(2 / pi)``: tanh-GELU's ``0.5 * x * (1 + tanh(u))`` is ``x * sigmoid(2 * u)``
_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)

#: on CPU, a weight up to this size is also kept transposed, (in, out) contiguous: MKL's sgemm then
#: takes its NN path, which packs nothing per call (1.27-1.33x per product at 32 rows, 96-512 wide;
#: 1.0x at 256 rows or 12 MiB weights, where the packing is amortised; same bits at those sizes)
TRANSPOSE_BYTES = 4 << 20


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
    where a key is attended (SDPA's boolean mask; ``stack_inputs`` always passes one), or None."""
    b, h, n, d = q.shape
    keys = k.shape[2]
    q3, k3, v3 = q.reshape(b * h, n, d), k.reshape(b * h, keys, d), v.reshape(b * h, keys, d)
    if mask is None:
        scores = torch.bmm(q3, k3.transpose(1, 2)) * scale
    else:
        bias = torch.where(mask, 0.0, float("-inf")).to(q.dtype).expand(b, h, n, keys).reshape(b * h, n, keys)
        scores = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(-1), v3).view(b, h, n, d)


class FrozenBlock(torch.nn.Module):
    """One block's ``joint_block`` operands as module state (what ``joint_block`` reads of a plan)."""

    def __init__(self, plan: BlockPlan, cpu: bool = False):
        super().__init__()
        self.cpu = cpu
        self.block = plan.block
        self.linears = plan.linears  # the block's own linears (submodules of ``block``)
        self.head_dim, self.approximate = plan.head_dim, plan.approximate
        for name in ("wt", "bt", "wi", "bi", "qk_txt", "qk_img", *(f"t{k}" for k in range(8))):
            self.register_buffer(name, None, persistent=False)
        self.sync(plan)

    def sync(self, plan: BlockPlan) -> None:
        """Point the buffers at the plan's current copies (replaced, never changed in place)."""
        (wt, bt), (wi, bi) = plan.fused
        if self.wt is not wt or self.wi is not wi or self.qk_txt is not plan._qk[0]:  # the plan rebuilt
            self.wt, self.bt, self.wi, self.bi = wt, bt, wi, bi
            self.qk_txt, self.qk_img = plan._qk
            for k in range(8):
                weight = self.operand(k)[0]
                small = self.cpu and weight.numel() * weight.element_size() <= TRANSPOSE_BYTES
                setattr(self, f"t{k}", weight.detach().t().contiguous() if small else None)
        self.eps = plan.eps

    def attend(self, q, k, v, mask) -> torch.Tensor:
        if self.cpu:
            return cpu_attend(q, k, v, mask, self.head_dim**-0.5)
        return BlockPlan.attend(q, k, v, mask)

    def operand(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``BlockPlan.operand`` read from this module's state."""
        if k == TXT_QKV:
            return self.wt, self.bt
        return (self.wi, self.bi) if k == IMG_QKV else own_operand(self.linears, k)

    def product(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """On CPU: ``x`` times the transposed copy (``sync``) where there is one, the bias added by
        the elementwise kernel that reads the product next (inductor's ``addmm`` first copies the bias
        into its output, a pass of its own)."""
        weight, bias = self.operand(k)
        if not self.cpu:
            return F.linear(x, weight, bias)
        transposed = getattr(self, f"t{k}")
        out = x @ transposed if transposed is not None else F.linear(x, weight)
        return out if bias is None else out + bias

    def act(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        return cpu_act(x, approximate) if self.cpu else BlockPlan.act(x, approximate)

    def norm_weight(self, text: int, image: int) -> torch.Tensor:
        """``BlockPlan.norm_weight`` without its cache (sizes are symbolic in the graph)."""
        return torch.cat([self.qk_txt.expand(text, -1, -1, -1), self.qk_img.expand(image, -1, -1, -1)])


class FrozenStack(torch.nn.Module):
    """Every block's ``joint_block`` in one forward; compiled by ``compile_stack``."""

    def __init__(self, plans: list[BlockPlan], cpu: bool = False):
        super().__init__()
        self.frozen = torch.nn.ModuleList(FrozenBlock(p, cpu) for p in plans)

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
    stack = FrozenStack(plans, cpu=torch.device(device).type == "cpu")
    if cuda_graphs:
        stack.compile(dynamic=True, mode="reduce-overhead")
    else:
        stack.compile(dynamic=True, options=options_for(device))
    return stack
