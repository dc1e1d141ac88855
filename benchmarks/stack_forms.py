"""The compiled block stack's CPU forms and its arena against the model's own operators, same process, alternating.

Qwen-Image's ``--compile`` runs the six blocks and the head as one inductor graph
(``families/qwenimage/fast_stack.py``). On CPU that graph computes attention as ``baddbmm`` + softmax +
``bmm``, tanh-GELU as ``x * sigmoid(2u)`` and every product against a transposed copy of its weight
with the bias added in the next elementwise kernel (``cpu=True``), and reads every operand from one
contiguous copy, the arena (what ``--compile`` builds on CPU for the default model). Variants, each the
same ``FrozenStack`` compiled with the same options (``accel/compile.CPU_OPTIONS``): the model's own
operators with every operand a graph input (``cpu=False``, no arena: SDPA, ``F.gelu``, ``F.linear``
with its bias), the CPU forms without the arena, the CPU forms with it. On the default model's rows:
one request's two fused-CFG rows, and 8 requests' 16 (a served step batch). One torch thread, process
time, best of ``--rounds`` rounds of ``--calls`` calls each, variants alternating; the output
difference against the eager stack beside it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/stack_forms.py --cache-dir /tmp/forms-ind
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from triptych.accel import SpeedConfig  # noqa: E402
from triptych.accel.compile import CPU_OPTIONS  # noqa: E402
from triptych.families.base import COND, UNCOND, GenerationParams, Row  # noqa: E402
from triptych.families.models import default_model_dir  # noqa: E402
from triptych.families.qwenimage.fast_stack import FrozenStack, stack_inputs  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--cache-dir", default=None, help="inductor cache (default: a fresh temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    speed = SpeedConfig(compile=True, compile_cache_dir=args.cache_dir) if args.cache_dir else SpeedConfig()
    family = load_family(default_model_dir(), dtype="float32", speed=speed)
    fast = family._fast
    fast.refresh()
    assert all(ops is not None for ops in fast.ops)  # every block takes joint_block
    head = (family.pipe.transformer.norm_out.norm, family.pipe.transformer.proj_out)
    variants = {"model's operators": (False, 0), "CPU forms": (True, 0), "CPU forms + arena": (True, None)}
    stacks = {}
    for name, (cpu, arena_bytes) in variants.items():
        stacks[name] = FrozenStack(fast.ops, head, cpu=cpu, arena_bytes=arena_bytes)
        stacks[name].compile(options=CPU_OPTIONS)  # as compile_stack: sizes marked dynamic by stack_inputs
    assert stacks["CPU forms + arena"].arena is not None and stacks["CPU forms"].arena is None
    params = family.resolve(GenerationParams(prompt="a red circle on a blue background", seed=0))
    inputs = {}
    with torch.no_grad():
        for requests in (1, 8):
            states = [family.prepare(f"b{i}", params, family.encode(params)) for i in range(requests)]
            rows = [Row(s, b) for b in (COND, UNCOND) for s in states]
            e = fast.embed(rows)
            inputs[2 * requests] = stack_inputs(e.hidden, e.txt, e.joint_mask, e.mods, e.rope[2], e.head)
            eager = FrozenStack(fast.ops, head, cpu=False, arena_bytes=0)(*inputs[2 * requests])[1]
            for name, stack in stacks.items():
                t = time.perf_counter()
                diff = float((stack(*inputs[2 * requests])[1] - eager).abs().max())
                print(
                    f"{name}, {2 * requests} rows: first call {time.perf_counter() - t:.1f} s, max abs vs eager {diff:.1e}"
                )
        times = {(name, n): [] for name in stacks for n in inputs}
        for r in range(args.rounds):
            for n, stack_args in inputs.items():
                for name in list(stacks) if r % 2 == 0 else list(stacks)[::-1]:
                    stack = stacks[name]
                    for _ in range(10):
                        stack(*stack_args)
                    t = time.process_time()
                    for _ in range(args.calls):
                        stack(*stack_args)
                    times[(name, n)].append((time.process_time() - t) / args.calls * 1e3)
    print(
        "\n| rows | model's operators ms | CPU forms ms | CPU forms + arena ms | forms speed-up | arena speed-up | both |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in inputs:
        a, b, c = (min(times[(name, n)]) for name in variants)
        print(f"| {n} | {a:.3f} | {b:.3f} | {c:.3f} | {a / b:.2f}x | {b / c:.2f}x | {a / c:.2f}x |")


if __name__ == "__main__":
    main()
