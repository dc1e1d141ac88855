"""The step's overhead, before and after the per-request tables (issue 27 item 1), same run.

For each model (the default model, small FLUX, small Wan), one family is loaded and two states of the
same request are prepared: one with the family's per-request step tables (``step_tables = True``,
the shipped setting: ``pipelines/<family>/fast.py``) and one without (the transformer's own forward at
every step, as before this change). Then, for ``--repeats`` rounds after a warm-up round, alternating
within each round:

- the transformer forward over one request's rows (both CFG branches when it has them) and over
  ``--batch`` rows (that many requests' rows stacked, as step batching runs them), up to
  ``--forwards`` forwards each (about a second's worth): best CPU time per forward, the operators it
  dispatches (profiler, top-level aten calls: a count the machine's load does not change), its share of the machine's measured fp32
  matmul rate (the FLOPs that forward runs, from ``torch.utils.flop_counter``, / its time / the
  1024x1024 matmul rate on one thread, measured in the same run); a family without tables (FLUX)
  runs the same forward on both sides;
- the default model only: one image in process (``run_request``, 20 steps, fused CFG) with and
  without the tables, and the diffusers pipeline's own ``__call__`` on the same weights; the output
  difference to diffusers beside each ratio.

One torch thread and process CPU time (the machine is shared; wall time swings several-fold).

    python benchmarks/step_overhead.py [--repeats 5] [--forwards 20] [--batch 8] [--models default flux wan]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
clock = time.process_time

from triptych.engine.runner import run_request  # noqa: E402
from triptych.families.base import GenerationParams, Row  # noqa: E402
from triptych.families.models import default_model_dir  # noqa: E402
from triptych.families.registry import load_family, make_tiny  # noqa: E402

PROMPT = "a red circle on a blue background"
MODELS = {"default": None, "flux": "flux", "wan": "wan-t2v"}


def matmul_gflops(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / min(_timed(lambda: a @ b) for _ in range(repeats)) / 1e9


def _timed(fn) -> float:
    t = clock()
    fn()
    return clock() - t


def flops_of(family, rows) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        family.forward(rows)
    return counter.get_total_flops()


def prepared(family, params, tables: bool, n: int):
    """``n`` states of ``params`` (seeds 0..n-1), prepared with or without the step tables."""
    family.step_tables = tables
    try:
        return [
            family.prepare(f"s{i}", params.replace(seed=i), family.encode(params.replace(seed=i))) for i in range(n)
        ]
    finally:
        family.step_tables = True


def rows_of(states) -> list[Row]:
    return [Row(s, b) for s in states for b in s.branches()]


def forward_rows(family, params, batch: int):
    """(label, rows with tables, rows without) for one request and for ``batch`` rows."""
    with_t, without = prepared(family, params, True, batch), prepared(family, params, False, batch)
    one = len(with_t[0].branches())
    out = [(f"{one} row(s): one request", rows_of(with_t[:1]), rows_of(without[:1]))]
    n = max(1, batch // one)
    out.append((f"{n * one} rows: {n} requests", rows_of(with_t[:n]), rows_of(without[:n])))
    return out


def op_count(family, rows) -> int:
    """Operators a forward dispatches (top-level aten calls, from the profiler): independent of load."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        family.forward(rows)
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


def bench_forwards(name, family, params, args, rate):
    results = []
    for label, new, old in forward_rows(family, params, args.batch):
        assert old[0].state.step_consts is None
        flops, flops_new = flops_of(family, old), flops_of(family, new)
        ops = (op_count(family, old), op_count(family, new))
        with torch.no_grad():
            diff = float((family.forward(new) - family.forward(old)).abs().max())
            # about a second of work per timing, at most --forwards forwards
            n = max(1, min(args.forwards, int(1.0 / max(_timed(lambda: family.forward(old)), 1e-6))))
            times = {"before": [], "after": []}
            for i in range(args.repeats + 1):
                for key, rows in (("before", old), ("after", new)):
                    t = _timed(lambda r=rows: [family.forward(r) for _ in range(n)]) / n
                    if i:
                        times[key].append(t)
        b, a = min(times["before"]), min(times["after"])
        tables = new[0].state.step_consts is not None
        results.append((name, label, tables, flops, flops_new, ops, b, a, flops / b / rate, flops_new / a / rate, diff))
    return results


def bench_images(family, params, args):
    images, times = {}, {"diffusers": [], "before": [], "after": []}
    runs = {
        "diffusers": lambda: family.reference_call(params)[0],
        "before": lambda: _run(family, params, False),
        "after": lambda: _run(family, params, True),
    }
    for i in range(args.repeats + 1):
        for key, fn in runs.items():
            t = clock()
            images[key] = np.asarray(fn(), dtype=np.float32)
            if i:
                times[key].append(clock() - t)
    return {k: min(v) for k, v in times.items()}, images


def _run(family, params, tables: bool):
    family.step_tables = tables
    try:
        return run_request(family, params)[0].array[0]
    finally:
        family.step_tables = True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    args = ap.parse_args(argv)
    rate = matmul_gflops() * 1e9
    print(f"torch {torch.__version__}, 1 thread, process CPU time; load average {os.getloadavg()[0]:.1f}")
    print(f"matmul 1024x1024 fp32: {rate / 1e9:.1f} GFLOP/s")
    rows, image = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            fam_name = MODELS[name]
            path = (
                default_model_dir() if fam_name is None else make_tiny(fam_name, tmp + "/" + name, seed=0, size="small")
            )
            family = load_family(path)
            negative = None if family.name.startswith("flux") else "blurry"
            params = family.resolve(GenerationParams(prompt=PROMPT, negative_prompt=negative, seed=0))
            if fam_name is None:
                params = family.resolve(GenerationParams(prompt=PROMPT, seed=0))
            rows += bench_forwards(name, family, params, args, rate)
            if fam_name is None:
                image = bench_images(family, params, args)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print(
        "| model | rows | tables | MFLOP before / after | operators before / after | before ms | after ms "
        "| speed-up | share before | share after | max abs after vs before |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, label, tables, flops, flops_new, ops, b, a, sb, sa, diff in rows:
        print(
            f"| {name} | {label} | {'yes' if tables else 'no'} | {flops / 1e6:.1f} / {flops_new / 1e6:.1f} "
            f"| {ops[0]} / {ops[1]} | {b * 1e3:.2f} | {a * 1e3:.2f} | {b / a:.2f}x "
            f"| {sb * 100:.1f}% | {sa * 100:.1f}% | {diff:.1e} |"
        )
    if image is not None:
        t, imgs = image
        print(
            "\n| default model, one image (20 steps, CFG 4) | CPU ms | vs diffusers `__call__` | max abs vs diffusers |"
        )
        print("|---|---|---|---|")
        for key in ("diffusers", "before", "after"):
            diff = float(np.abs(imgs[key] - imgs["diffusers"]).max())
            print(f"| {key} | {t[key] * 1e3:.0f} | {t['diffusers'] / t[key]:.2f}x | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
