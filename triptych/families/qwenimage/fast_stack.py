"""``--compile`` on Qwen-Image's fast path: the whole block stack as one inductor graph.

The regional compile (``accel/compile.py``) compiles each block as a module; on the fast path
(``fast.py``) that was slower than the eager ``joint_block`` kernel on CPU (benchmarks/RESULTS.md,
"--compile and --quantize"): at a few dozen tokens the step is call overhead, and a compiled block is
still one guarded call per block. Here the six ``joint_block`` calls are one graph
(``nn.Module.compile``; the batch and sequence sizes symbolic from the first compile, as the regional
blocks': ``stack_inputs`` marks them dynamic). On CPU it compiles with ``cpp_wrapper`` (the graph's calls are made
from C++, not Python; ``accel/compile.CPU_OPTIONS``); on other devices with the default options.

On CPU the stack also computes three things in forms that inductor's CPU code runs faster at a few
dozen tokens (same functions, other rounding; within the tolerances of tests/pipelines/test_compile.py
and test_compile_stack.py): attention as ``baddbmm`` + softmax + ``bmm`` (``cpu_attend``), tanh-GELU
as ``x * sigmoid(2u)`` (``cpu_act``), and every product against a transposed copy of its weight with
the bias added in the next elementwise kernel (``FrozenBlock.product``). Their gain is measured by
``benchmarks/stack_forms.py`` (benchmarks/RESULTS.md).

The operands live on this module so that dynamo sees them as module state (graph inputs, not
constants). Where every block's operands together (weights, biases, q/k norm weights) take at most
``ARENA_BYTES``, they are one contiguous copy, the *arena*, and the compiled forward reads them as views
of it (``ArenaBlock``): the graph then has a handful of inputs instead of ~120, and what a call costs
around its kernels (dynamo's and AOT autograd's wrappers, the C++ wrapper's per-input handles) shrinks
with them, with the same bits (benchmarks/RESULTS.md).
Larger stacks (a real checkpoint, where a copy of every weight would double the memory) keep each
operand as a buffer of its ``FrozenBlock``: the fused q/k/v copies, the transposed copies and q/k norm
weights, the block (its linears) as a submodule. Either way the copies are copies, so ``sync`` replaces
them whenever ``BlockPlan.current`` rebuilt the plan after a weight was replaced or changed in place (held by
tests/pipelines/test_compile_stack.py); nothing in Triptych changes a transformer weight after load
(LoRA adds its deltas in hooks; rows with an adapter do not take the fast path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from triptych.accel.compile import options_for
from triptych.families.qwenimage.fast_block import IMG_QKV, TXT_QKV, BlockPlan, joint_block, own_operand
from triptych.families.qwenimage.fast_watch import Watch

#: ``2 * sqrt(2 / pi)``: tanh-GELU's ``0.5 * x * (1 + tanh(u))`` is ``x * sigmoid(2 * u)``
_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)

#: on CPU, a weight up to this size is also kept transposed, (in, out) contiguous: MKL's sgemm then
#: takes its NN path, which packs nothing per call (1.27-1.33x per product at 32 rows, 96-512 wide;
#: 1.0x at 256 rows or 12 MiB weights, where the packing is amortised; same bits at those sizes)
TRANSPOSE_BYTES = 4 << 20

#: a stack whose operands total at most this many bytes reads them from one contiguous copy (the
#: module docstring); the default model's: 5.3 MB
ARENA_BYTES = 64 << 20


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
    """One block's ``joint_block`` operands as module state (what ``joint_block`` reads of a plan); in an
    arena stack (``arena=True``) only their places in the arena (``layout``), read through ``ArenaBlock``."""

    def __init__(self, plan: BlockPlan, cpu: bool = False, arena: bool = False):
        super().__init__()
        self.cpu, self.in_arena = cpu, arena
        self.block = plan.block
        self.linears = plan.linears  # the block's own linears (submodules of ``block``)
        self.head_dim, self.approximate = plan.head_dim, plan.approximate
        #: arena form: name -> (offset, shape) of each operand (``operands``' names)
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.transposed: tuple[bool, ...] = (False,) * 8  # per product: its weight kept transposed
        for name in ("wt", "bt", "wi", "bi", "qk_txt", "qk_img", *(f"t{k}" for k in range(8))):
            self.register_buffer(name, None, persistent=False)
        self.sync(plan)

    def sync(self, plan: BlockPlan) -> bool:
        """Point at the plan's current copies (replaced, never changed in place); whether they changed."""
        (wt, bt), (wi, bi) = plan.fused
        changed = self.wt is not wt or self.wi is not wi or self.qk_txt is not plan._qk[0]  # the plan rebuilt
        if changed:
            self.wt, self.bt, self.wi, self.bi = wt, bt, wi, bi
            self.qk_txt, self.qk_img = plan._qk
            small = [self.cpu and self.operand(k)[0].numel() * wt.element_size() <= TRANSPOSE_BYTES for k in range(8)]
            self.transposed = tuple(small)
            for k in range(8):  # the arena holds its own transposed copies (``operands``)
                keep = small[k] and not self.in_arena
                setattr(self, f"t{k}", self.operand(k)[0].detach().t().contiguous() if keep else None)
            self.eps = plan.eps
        return changed

    def operands(self) -> list[tuple[str, torch.Tensor]]:
        """What ``joint_block`` reads, by name: ``w<k>`` (product ``k``'s weight, (in, out) where
        ``transposed[k]``), ``b<k>`` (its bias, if any), the q/k norm weights."""
        out = []
        for k in range(8):
            weight, bias = self.operand(k)
            out.append((f"w{k}", weight.detach().t() if self.transposed[k] else weight.detach()))
            if bias is not None:
                out.append((f"b{k}", bias.detach()))
        return out + [("qk_txt", self.qk_txt), ("qk_img", self.qk_img)]

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
        return _product(self.cpu, x, weight, getattr(self, f"t{k}"), bias)

    def act(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        return cpu_act(x, approximate) if self.cpu else BlockPlan.act(x, approximate)

    def norm_weight(self, text: int, image: int) -> torch.Tensor:
        """``BlockPlan.norm_weight`` without its cache (sizes are symbolic in the graph)."""
        return torch.cat([self.qk_txt.expand(text, -1, -1, -1), self.qk_img.expand(image, -1, -1, -1)])


def _product(cpu: bool, x, weight, transposed, bias) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on CPU against ``transposed`` (``weight.t()``, contiguous) where
    given, the bias added after (``FrozenBlock.product``)."""
    if not cpu:
        return F.linear(x, weight, bias)
    out = x @ transposed if transposed is not None else F.linear(x, weight)
    return out if bias is None else out + bias


def _view(arena: torch.Tensor, layout: dict, name: str) -> torch.Tensor | None:
    """Operand ``name`` as the view of ``arena`` that ``layout`` places it at; None where it has none."""
    place = layout.get(name)
    if place is None:
        return None
    offset, shape = place
    return arena[offset : offset + math.prod(shape)].view(shape)


class ArenaBlock:
    """``joint_block``'s plan for one ``FrozenBlock`` of an arena stack: its operands as views of the
    arena. Made by ``FrozenStack.forward`` at every call, inside the traced graph, so the views cost
    nothing at run time (inductor reads the arena at fixed offsets)."""

    def __init__(self, frozen: FrozenBlock, arena: torch.Tensor):
        self.frozen, self.arena = frozen, arena
        self.block, self.head_dim = frozen.block, frozen.head_dim
        self.approximate, self.eps = frozen.approximate, frozen.eps

    def tensor(self, name: str) -> torch.Tensor | None:
        return _view(self.arena, self.frozen.layout, name)

    def product(self, k: int, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.tensor(f"w{k}"), self.tensor(f"b{k}")
        if self.frozen.transposed[k]:
            return _product(True, x, None, weight, bias)
        return _product(self.frozen.cpu, x, weight, None, bias)

    def attend(self, q, k, v, mask) -> torch.Tensor:
        return self.frozen.attend(q, k, v, mask)

    def act(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        return self.frozen.act(x, approximate)

    def norm_weight(self, text: int, image: int) -> torch.Tensor:
        txt, img = self.tensor("qk_txt"), self.tensor("qk_img")
        return torch.cat([txt.expand(text, -1, -1, -1), img.expand(image, -1, -1, -1)])


class FrozenStack(torch.nn.Module):
    """Every block's ``joint_block`` in one forward, then the model's head on its output (``head``:
    ``norm_out``'s LayerNorm and ``proj_out``, with each row's (1 + scale, shift) as an input);
    compiled by ``compile_stack``. Returns (the blocks' image stream, the head's output or None)."""

    def __init__(self, plans: list[BlockPlan], cpu: bool = False, head=None, arena_bytes: int | None = None):
        super().__init__()
        arena_bytes = ARENA_BYTES if arena_bytes is None else arena_bytes
        self.cpu = cpu
        self.norm, self.proj = head if head is not None else (None, None)
        total = sum(_plan_bytes(p) for p in plans) + sum(_bytes(t) for _, _, t in self._head_params())
        self.frozen = torch.nn.ModuleList(FrozenBlock(p, cpu, arena=total <= arena_bytes) for p in plans)
        self.register_buffer("arena", None, persistent=False)
        self.head_layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._head = Watch.of((), self._head_owners())  # the head's parameters as ``sync`` last saw them
        if total <= arena_bytes:
            self._build_arena()

    def _head_owners(self) -> list[tuple[torch.nn.Module, str]]:
        mods = [(self.norm, "weight"), (self.norm, "bias"), (self.proj, "weight"), (self.proj, "bias")]
        return [(m, n) for m, n in mods if m is not None]

    def _head_params(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        return [(m, n, m._parameters[n]) for m, n in self._head_owners() if m._parameters.get(n) is not None]

    def head_watch(self) -> Watch:
        """The head's parameters as ``sync`` last saw them (``FastForward.stack``'s one check per forward)."""
        return self._head

    def sync(self, plans: list[BlockPlan]) -> None:
        """Follow the plans' and the head's current weights (``FastForward.stack``, every forward)."""
        changed = False
        for block, plan in zip(self.frozen, plans):
            changed = block.sync(plan) or changed
        if not self._head.holds(frozenset()):
            self._head, changed = Watch.of((), self._head_owners()), True
        if changed and self.arena is not None:
            self._build_arena()

    def _head_operands(self) -> list[tuple[str, torch.Tensor]]:
        out, self.proj_transposed = [], False
        for module, name, param in self._head_params():
            key = ("proj_" if module is self.proj else "norm_") + name
            transpose = key == "proj_weight" and self.cpu and _bytes(param) <= TRANSPOSE_BYTES
            self.proj_transposed = self.proj_transposed or transpose
            out.append((key, param.detach().t() if transpose else param.detach()))
        return out

    def _build_arena(self) -> None:
        """One contiguous copy of every block's ``operands`` and the head's; ``layout``s say where."""
        parts, offset = [], 0
        layouts = [(block.layout, block.operands()) for block in self.frozen]
        layouts.append((self.head_layout, self._head_operands()))
        for layout, operands in layouts:
            layout.clear()
            for name, tensor in operands:
                layout[name] = (offset, tuple(tensor.shape))
                parts.append(tensor.reshape(-1))
                offset += tensor.numel()
        self.arena = torch.cat(parts)

    def _head_tensor(self, name: str, module, attr: str):
        return getattr(module, attr) if self.arena is None else _view(self.arena, self.head_layout, name)

    def head(self, hidden, head_mods) -> torch.Tensor:
        """``FastForward.head``'s arithmetic: LayerNorm, (1 + scale, shift), ``proj_out``."""
        norm, proj = self.norm, self.proj
        weight = self._head_tensor("norm_weight", norm, "weight")
        bias = self._head_tensor("norm_bias", norm, "bias")
        hidden = F.layer_norm(hidden, norm.normalized_shape, weight, bias, norm.eps) * head_mods[0] + head_mods[1]
        proj_weight = self._head_tensor("proj_weight", proj, "weight")
        proj_bias = self._head_tensor("proj_bias", proj, "bias")
        if self.arena is not None and self.proj_transposed:
            return _product(True, hidden, None, proj_weight, proj_bias)
        return _product(False, hidden, proj_weight, None, proj_bias)

    def forward(self, hidden, txt, mask, mods, joint_freqs, head_mods):
        flat = mods.reshape(-1, *mods.shape[3:]).unbind(0)
        blocks = self.frozen if self.arena is None else [ArenaBlock(b, self.arena) for b in self.frozen]
        for i, block in enumerate(blocks):
            mod = (flat[12 * i : 12 * i + 6], flat[12 * i + 6 : 12 * i + 12])
            hidden, txt = joint_block(block, hidden, txt, mask, mod, joint_freqs)
        return hidden, (None if self.proj is None else self.head(hidden, head_mods))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plan_bytes(plan: BlockPlan) -> int:
    """What a block's operands take in an arena: its linears' weights and biases, the q/k norm weights."""
    tensors = [t for m in plan.linears for t in (m.weight, m.bias) if t is not None]
    tensors += [n.weight for n in plan.norms]
    return sum(_bytes(t) for t in tensors)


#: the sizes of ``stack_inputs``' tensors that vary between calls (rows, text and image tokens), marked
#: dynamic for the compile (``compile_stack``) instead of ``dynamic=True``, whose config patch around
#: every call and dynamic Python floats cost time at every call
_DYNAMIC = ([0, 1], [0, 1], [0, 3], [3], [0], [1])


def stack_inputs(hidden, txt, mask, mods, joint_freqs, head_mods) -> tuple:
    """The stack's arguments in one form for every call, so that a mixed load compiles two graphs
    (one row, where dynamo specialises the size 1, and several rows) instead of five: a one-row
    modulation table (blocks, 2, 6, dim) as (blocks, 2, 6, 1, 1, dim) and its head's (2, dim) as
    (2, 1, 1, dim), the same broadcast over the row's tokens; no text mask as an all-True key mask (every key attended, as without one); every
    tensor contiguous and its own, not a view: dynamo guards on a view input's base, so a graph traced
    with a view (a step's row of the schedule tables) failed its guards on a tensor that is none
    (TeaCache's indexed sub-batches) and compiled another. Counted by tests/pipelines/test_compile.py."""
    if mods.dim() == 4:
        mods = mods[:, :, :, None, None]
    if head_mods.dim() == 2:
        head_mods = head_mods[:, None, None]
    if mask is None:
        mask = hidden.new_ones((hidden.shape[0], 1, 1, txt.shape[1] + hidden.shape[1]), dtype=torch.bool)
    args = tuple(_own(x) for x in (hidden, txt, mask, mods, joint_freqs, head_mods))
    for x, dims in zip(args, _DYNAMIC):
        torch._dynamo.maybe_mark_dynamic(x, dims)
    return args


def _own(x: torch.Tensor) -> torch.Tensor:
    return x if x._base is None and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def compile_stack(plans: list[BlockPlan], head, device: torch.device | str, cuda_graphs: bool = False) -> FrozenStack:
    """A ``FrozenStack`` over ``plans`` (each ``current()``) and ``head`` (``norm_out``'s LayerNorm,
    ``proj_out``), compiled for ``device``; ``cuda_graphs``
    (a CUDA device): with torch.compile's ``reduce-overhead`` mode, whose CUDA graph trees record one
    graph per input shape and replay it (the caller marks each call a new step and copies the
    output out of the graphs' pool: ``FastForward.blocks``)."""
    stack = FrozenStack(plans, cpu=torch.device(device).type == "cpu", head=head)
    if cuda_graphs:
        stack.compile(dynamic=True, mode="reduce-overhead")
    else:
        stack.compile(options=options_for(device))  # dynamic sizes: as ``stack_inputs`` marks them
    return stack
