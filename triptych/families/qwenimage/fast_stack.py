"""``--compile`` on Qwen-Image's fast path: every ``joint_block`` and the head as one inductor graph.

The regional compile (``accel/compile.py``) compiles each block as a module; on the fast path at a
few dozen tokens the step is call overhead, and a compiled block is still one guarded call per
block (benchmarks/RESULTS.md, "--compile and --quantize"). Here the blocks are one graph
(``nn.Module.compile``; the batch and sequence sizes symbolic, as ``stack_inputs`` marks them); on
CPU with ``cpp_wrapper`` (``accel/compile.CPU_OPTIONS``) and ``joint_block``'s CPU forms.

The operands are module state (graph inputs, not constants): where they take at most
``ARENA_BYTES`` all of them are one contiguous copy, the *arena*, read as views at fixed offsets
(a handful of graph inputs instead of ~120: less cost around the kernels, the same bits;
benchmarks/stack_forms.py); larger stacks (a real checkpoint, where a copy of every weight would
double the memory) keep each as a buffer, the model's own weights aliased, not copied. ``load``
replaces them whenever the fast path's ``Stamp`` saw a weight replaced or changed in place
(tests/pipelines/test_compile_stack.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from triptych.accel.compile import options_for
from triptych.families.qwenimage.fast_block import Operands, joint_block

#: on CPU, a weight up to this size is also kept transposed, (in, out) contiguous: MKL's sgemm then
#: takes its NN path, which packs nothing per call (same bits at those sizes; the gain is measured by
#: benchmarks/stack_forms.py)
TRANSPOSE_BYTES = 4 << 20

#: a stack whose operands total at most this many bytes reads them from one contiguous copy (the arena)
ARENA_BYTES = 64 << 20

_PER_BLOCK = 18  # 8 weights, 8 biases, 2 q/k norm weights: ``_flat``'s order


def _flat(p: Operands, cpu: bool) -> tuple[list[torch.Tensor | None], tuple[bool, ...]]:
    """``p``'s tensors in ``_PER_BLOCK`` order, each weight transposed where that pays on CPU."""
    transposed = tuple(cpu and w.numel() * w.element_size() <= TRANSPOSE_BYTES for w in p.weights)
    weights = [w.t().contiguous() if t else w for w, t in zip(p.weights, transposed)]
    return [*weights, *p.biases, *p.qk], transposed


class FrozenStack(torch.nn.Module):
    """Every block's ``joint_block`` on its ``Operands``, then the model's head on the output
    (``norm_out``'s LayerNorm with each row's (1 + scale, shift), ``proj_out``). Returns (the blocks'
    image stream, the head's output)."""

    def __init__(self, ops: list[Operands], head, cpu: bool = False, arena_bytes: int | None = None):
        super().__init__()
        self.cpu, self.arena_bytes = cpu, ARENA_BYTES if arena_bytes is None else arena_bytes
        self.register_buffer("arena", None, persistent=False)
        self.load(ops, head)

    def load(self, ops: list[Operands], head) -> None:
        """Take ``ops`` and ``head`` (``norm_out``'s LayerNorm, ``proj_out``) as the operands."""
        norm, proj = head
        self.consts = [(p.head_dim, p.eps, p.ln_eps, p.approximate) for p in ops]
        self.norm_shape, self.norm_eps = norm.normalized_shape, norm.eps
        tensors, self.transposed = [], []
        for p in ops:
            flat, transposed = _flat(p, self.cpu)
            tensors += flat
            self.transposed.append(transposed)
        w = proj.weight.detach()
        self.proj_transposed = self.cpu and w.numel() * w.element_size() <= TRANSPOSE_BYTES
        tensors += [norm.weight, norm.bias, w.t().contiguous() if self.proj_transposed else w, proj.bias]
        tensors = [None if t is None else t.detach() for t in tensors]
        total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        self.count = len(tensors)
        if total <= self.arena_bytes:
            self.layout, offset = [], 0
            for t in tensors:
                self.layout.append(None if t is None else (offset, tuple(t.shape)))
                offset += 0 if t is None else t.numel()
            self.arena = torch.cat([t.reshape(-1) for t in tensors if t is not None])
        else:
            self.layout, self.arena = None, None
            for i, t in enumerate(tensors):
                self.register_buffer(f"op{i}", t, persistent=False)

    def _tensors(self) -> list[torch.Tensor | None]:
        if self.arena is None:
            return [getattr(self, f"op{i}") for i in range(self.count)]
        a = self.arena  # views inside the traced graph: inductor reads the arena at fixed offsets
        return [None if p is None else a[p[0] : p[0] + math.prod(p[1])].view(p[1]) for p in self.layout]

    def forward(self, hidden, txt, mask, mods, joint_freqs, head_mods):
        flat, tensors = mods.reshape(-1, *mods.shape[3:]).unbind(0), self._tensors()
        for i, consts in enumerate(self.consts):
            t = tensors[_PER_BLOCK * i : _PER_BLOCK * (i + 1)]
            p = Operands(t[:8], t[8:16], self.transposed[i], (t[16], t[17]), consts)
            mod = (flat[12 * i : 12 * i + 6], flat[12 * i + 6 : 12 * i + 12])
            hidden, txt = joint_block(p, hidden, txt, mask, mod, joint_freqs, cpu=self.cpu)
        norm_w, norm_b, proj_w, proj_b = tensors[-4:]
        out = F.layer_norm(hidden, self.norm_shape, norm_w, norm_b, self.norm_eps) * head_mods[0] + head_mods[1]
        if self.proj_transposed:
            out = out @ proj_w if proj_b is None else out @ proj_w + proj_b
        else:
            out = F.linear(out, proj_w, proj_b)
        return hidden, out


#: the sizes of ``stack_inputs``' tensors that vary between calls (rows, text and image tokens), marked
#: dynamic instead of ``dynamic=True``, whose config patch around every call costs time at every call
_DYNAMIC = ([0, 1], [0, 1], [0, 3], [3], [0], [1])


def stack_inputs(hidden, txt, mask, mods, joint_freqs, head_mods) -> tuple:
    """The stack's arguments in one form for every call, so that a mixed load compiles two graphs
    (one row, where dynamo specialises the size 1, and several rows) instead of five: one row's
    modulation (blocks, 2, 6, dim) as (blocks, 2, 6, 1, 1, dim) and its head's (2, dim) as
    (2, 1, 1, dim); no text mask as an all-True key mask; the streams and the modulation (views: of a
    linear's output, of a table or of the schedule, whose bases dynamo would guard on) copied into
    tensors of their own. Counted by tests/pipelines/test_compile.py."""
    if mods.dim() == 4:
        mods = mods[:, :, :, None, None]
    if head_mods.dim() == 2:
        head_mods = head_mods[:, None, None]
    if mask is None:
        mask = hidden.new_ones((hidden.shape[0], 1, 1, txt.shape[1] + hidden.shape[1]), dtype=torch.bool)
    hidden, txt, mods, head_mods = (
        x.clone(memory_format=torch.contiguous_format) for x in (hidden, txt, mods, head_mods)
    )
    args = (hidden, txt, mask, mods, joint_freqs, head_mods)  # the mask and frequencies: made by a cat
    for x, dims in zip(args, _DYNAMIC):
        # NOTE: torch's API to mark a size dynamic for dynamo lives in ``torch._dynamo`` only
        torch._dynamo.maybe_mark_dynamic(x, dims)
    return args


def compile_stack(ops: list[Operands], head, device, cuda_graphs: bool = False) -> FrozenStack:
    """A ``FrozenStack`` compiled for ``device``; ``cuda_graphs``: with ``reduce-overhead`` (CUDA graph
    trees record one graph per input shape; the caller marks each call a new step and copies the
    output out of the graphs' pool: ``FastForward.run``)."""
    stack = FrozenStack(ops, head, cpu=torch.device(device).type == "cpu")
    if cuda_graphs:
        stack.compile(dynamic=True, mode="reduce-overhead")
    else:
        stack.compile(options=options_for(device))  # dynamic sizes: as ``stack_inputs`` marks them
    return stack
