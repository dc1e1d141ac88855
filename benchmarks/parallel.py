"""Multi-rank denoising on CPU: Triptych's CFG / Ulysses / ring parallel vs one rank and vs diffusers'
own context parallel, on the same weights, in the same run.

    python benchmarks/parallel.py --family flux wan-t2v --size small --height 64 --width 64 --steps 2 --repeats 3

Two spawned gloo ranks (loopback, free port), one torch thread each. Per round, alternating, after
one warm-up round:

- ``single``: rank 0 alone runs the serving engine (``DenoiserEngine``, CFG fused; the other rank waits);
- ``triptych <mode>``: both ranks run the same engine step through ``apply_parallel(...).wrap(forward)``
  for CFG-2, Ulysses-2 and ring-2 (ring through Triptych's log-sum-exp attention backend); Ulysses
  twice: as served (``uneven_sequences=True``: any token count, diffusers' ``ulysses_anything``
  path plus Triptych's uneven gather) and ``ulysses2-even`` (diffusers' equal split, like the peer);
- ``diffusers <mode>``: both ranks run the same step on a second copy of the weights with
  diffusers' plain ``transformer.enable_parallelism(ContextParallelConfig(...))`` (its own mesh;
  the only help is Triptych's CPU device-count shim). diffusers has no CFG parallel, and its ring
  fails on CPU (the native backend refuses ``return_lse``): those cells say so.

The request uses true CFG (FLUX: a negative prompt and ``true_cfg`` 3; others: ``guidance`` 4), so a
step is one fused forward of 2 rows. Time: wall seconds of the denoise loop on rank 0 between two
barriers, best of ``--repeats``; ``× single`` < 1 is faster than one rank. ``max |Δ|``: latents after
the loop against single rank. On a shared 2-core machine two ranks have at most 2 cores; figures
for tiny sequences measure communication overhead more than parallel speed-up. ``ulysses2-even``
against diffusers is an A/A pair (the same diffusers split, attention and gather on both sides):
its distance from 1 is the run's noise, and differences in the other ratios smaller than it mean
nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("cfg2", "ulysses2", "ulysses2-even", "ring2")
CONFIGS = {
    "cfg2": dict(cfg=2),
    "ulysses2": dict(ulysses=2),
    "ulysses2-even": dict(ulysses=2, uneven_sequences=False),  # diffusers' equal split, as the peer
    "ring2": dict(ring=2),
}
PEER = {"ulysses2": "ulysses2", "ulysses2-even": "ulysses2", "ring2": "ring2"}  # the diffusers run each compares to


def _params(family_name: str, args):
    from triptych.families.base import GenerationParams

    common = dict(prompt="a red circle on blue", height=args.height, width=args.width, steps=args.steps, seed=1)
    if family_name.startswith("flux"):
        return GenerationParams(negative_prompt="blurry", true_cfg=3.0, **common)
    if family_name.startswith("wan"):
        common["frames"] = args.frames
    return GenerationParams(negative_prompt="noise", guidance=4.0, **common)


def _timed(groups, family, params, cond, forward=None, active=True) -> tuple[float, torch.Tensor | None]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    latents = None
    if active:  # the serving engine, the ranks' forward as its wrap (as instance_engine builds it)
        from triptych.engine import DenoiserEngine, EngineConfig

        state = family.prepare("bench", params, cond)
        wrap = None if forward is None else (lambda _: forward)
        engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1), wrap=wrap)
        engine.add(state)
        engine.run_until_done()
        latents = state.latents
    dist.barrier()
    return time.perf_counter() - start, latents


def _diffusers_peer(family, mode: str):
    """diffusers' own context parallel on this family's transformer; None with the reason if it fails."""
    from diffusers import ContextParallelConfig

    from triptych.parallel import cpu_device_count_shim

    degree = {"ulysses2": dict(ulysses_degree=2), "ring2": dict(ring_degree=2)}[mode]
    with cpu_device_count_shim():
        family.pipe.transformer.enable_parallelism(config=ContextParallelConfig(**degree))
    return family


def bench_rank(rank: int, device, model_dir: str, args) -> dict:
    """One rank's share of the benchmark (module level: spawned ranks import it)."""
    from triptych.families.registry import load_family
    from triptych.parallel import ParallelConfig, ParallelGroups, apply_parallel

    torch.set_num_threads(1)
    ours = load_family(model_dir)
    params = ours.resolve(_params(ours.name, args))
    cond = ours.encode(params)
    groups = {mode: ParallelGroups.build(ParallelConfig(**CONFIGS[mode]), device) for mode in MODES}
    peers: dict = {}
    peer_errors: dict = {"cfg2": "— (diffusers has no CFG parallel)"}
    for mode in ("ulysses2", "ring2"):
        family = load_family(model_dir)
        try:
            peers[mode] = _diffusers_peer(family, mode)
            _timed(groups[mode], family, params, cond)  # fails here for ring: native refuses return_lse
        except Exception as e:  # noqa: BLE001 - a failing peer is a table cell, not a crash
            peers.pop(mode, None)
            peer_errors[mode] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    times: dict[str, list[float]] = {}
    diffs: dict[str, float] = {}
    for round_index in range(args.repeats + 1):  # round 0 is the warm-up
        t, reference = _timed(groups["cfg2"], ours, params, cond, active=rank == 0)
        results = {"single": (t, reference)}
        for mode in MODES:
            parallel = apply_parallel(ours.pipe.transformer, groups[mode])
            try:
                results[f"triptych {mode}"] = _timed(groups[mode], ours, params, cond, parallel.wrap(ours.forward))
            finally:
                parallel.remove()
            if mode in peers:
                results[f"diffusers {mode}"] = _timed(groups[mode], peers[mode], params, cond)
        if round_index == 0:
            continue
        for name, (t, latents) in results.items():
            times.setdefault(name, []).append(t)
            if rank == 0 and latents is not None and name != "single":
                diffs[name] = (latents - reference).abs().max().item()
    return dict(times={k: min(v) for k, v in times.items()}, diffs=diffs, peer_errors=peer_errors)


def table(result: dict, family: str, size: str, params: int) -> str:
    times, diffs = result["times"], result["diffs"]
    single = times["single"]
    lines = [
        "| family | size | transformer params | mode | single ms | triptych ms | × single | diffusers ms | triptych ÷ diffusers | max abs Δ vs single |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        ours = times[f"triptych {mode}"]
        peer = times.get(f"diffusers {PEER.get(mode, mode)}")
        peer_ms = f"{peer * 1e3:.1f}" if peer is not None else result["peer_errors"][mode]
        ratio = f"{ours / peer:.3f}" if peer is not None else "—"
        lines.append(
            f"| {family} | {size} | {params / 1e6:.2f}M | {mode} | {single * 1e3:.1f} | {ours * 1e3:.1f} | "
            f"{ours / single:.3f} | {peer_ms} | {ratio} | {diffs[f'triptych {mode}']:.2g} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family", nargs="+", default=["flux"], help="make-tiny families (flux, qwen-image, wan-t2v, ...)"
    )
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--frames", type=int, default=5, help="video families")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from safetensors import safe_open

    from triptych.families.registry import make_tiny
    from triptych.parallel import run_ranks

    start = time.perf_counter()
    tables = []
    with tempfile.TemporaryDirectory(prefix="triptych-bench-parallel-") as root:
        for family in args.family:
            model_dir = str(make_tiny(family, Path(root) / family, seed=0, size=args.size))
            params = 0
            for f in (Path(model_dir) / "transformer").glob("*.safetensors"):
                with safe_open(str(f), "pt") as st:
                    params += sum(_numel(st, k) for k in st.keys())
            results = run_ranks(bench_rank, 2, (model_dir, args), timeout_s=600, collective_timeout_s=300)
            tables.append(table(results[0], family, args.size, params))
    header, rule, *_ = tables[0].splitlines()
    print("\n".join([header, rule] + [line for t in tables for line in t.splitlines()[2:]]))
    print(f"\n({time.perf_counter() - start:.0f} s; {' '.join(sys.argv)})")
    return 0


def _numel(st, key: str) -> int:
    n = 1
    for d in st.get_slice(key).get_shape():
        n *= d
    return n


if __name__ == "__main__":
    raise SystemExit(main())
