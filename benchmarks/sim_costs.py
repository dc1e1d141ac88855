"""Measure the simulator's cost model: the default model's stage costs, in process, one torch thread.

For each size and each batch occupancy n in 1..``--max-batch``: the seconds of one
``DenoiserEngine`` tick stepping n requests of that size together (median over ``--ticks`` ticks,
after ``--warmup``); the seconds of one text encode (``family.encode``) and of one decode per size.
Seconds are the process's CPU time by default (``--clock cpu``: one torch thread, so on a shared
machine it is the cost without other processes' contention; ``wall`` for wall time).
Writes ``--out`` JSON in the form ``triptych.sim.costs.CostModel.load`` reads; the HTTP, transfer
and head overhead per request (``overhead_s``) is taken from a recorded goodput run
(``--unloaded``, benchmarks/goodput.json's unloaded latencies) as the median of measured minus
modelled unloaded latency.

    python benchmarks/sim_costs.py --out benchmarks/sim_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--ticks", type=int, default=7, help="ticks timed per (size, occupancy)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="encodes and decodes timed")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--unloaded", default=str(ROOT / "benchmarks" / "goodput.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "sim_costs.json"))
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from triptych.engine import DenoiserEngine, EngineConfig
    from triptych.families.base import GenerationParams
    from triptych.families.models import default_model_dir
    from triptych.families.registry import load_family

    family = load_family(default_model_dir())
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    load0 = os.getloadavg()
    tick_s: dict[str, dict[str, float]] = {}
    decode_s: dict[str, float] = {}
    encode_times = []
    with torch.no_grad():
        for size in args.sizes:
            params = [
                family.resolve(
                    GenerationParams(prompt=f"object {i} on a plain background", seed=i, height=size, width=size)
                )
                for i in range(args.max_batch)
            ]
            conds = []
            for p in params:
                t = clock()
                conds.append(family.encode(p))
                encode_times.append(clock() - t)
            table = {}
            for n in range(1, args.max_batch + 1):
                engine = DenoiserEngine(family, EngineConfig(max_batch_requests=n))
                for i in range(n):
                    engine.add(family.prepare(f"r{size}-{n}-{i}", params[i].replace(steps=1000), conds[i]))
                times = []
                for _ in range(args.warmup + args.ticks):
                    t = clock()
                    engine.step()
                    times.append(clock() - t)
                times = times[args.warmup :]
                table[str(n)] = statistics.median(times)
                print(f"# {size}x{size} occupancy {n}: tick {table[str(n)] * 1e3:.1f} ms", flush=True)
            tick_s[f"{size}x{size}"] = table
            engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1))
            engine.add(family.prepare("d", params[0].replace(steps=2), conds[0]))
            state = list(engine.run_until_done())[0]
            times = []
            for _ in range(args.repeats):
                t = clock()
                family.decode(state.latents, state.params)
                times.append(clock() - t)
            decode_s[f"{size}x{size}"] = statistics.median(times)
            print(f"# {size}x{size} decode {decode_s[f'{size}x{size}'] * 1e3:.1f} ms", flush=True)
    out = {
        "model": "packaged default",
        "threads": 1,
        "clock": args.clock,
        "tick_s": tick_s,
        "encode_s": statistics.median(encode_times),
        "decode_s": decode_s,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    measured = json.loads(Path(args.unloaded).read_text()).get("unloaded_s", {}) if args.unloaded else {}
    gaps = []
    for key, seconds in measured.items():
        if key == "chat":
            out["chat_s"] = seconds
            continue
        shape, steps = key.split("/")
        model = out["encode_s"] + int(steps) * tick_s[shape]["1"] + decode_s[shape]
        gaps.append(seconds - model)
    out["overhead_s"] = max(0.0, statistics.median(gaps)) if gaps else 0.0
    out["overhead_from"] = args.unloaded
    print(f"# encode {out['encode_s'] * 1e3:.1f} ms; overhead {out['overhead_s'] * 1e3:.1f} ms per request")
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
