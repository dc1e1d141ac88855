"""The head's scheduler simulated (triptych.sim): checked against a measured goodput run, then at
cluster scale, then under a load step with the autoscaler.

Issue 45 item 6. Every part runs the real admission, deadline check, fair queue, router,
``pick_batch`` preemption and (part 3) ``Autoscaler`` on a virtual clock, with the stage costs of
``--costs`` (benchmarks/sim_costs.py measures them).

1. ``check``: benchmarks/goodput.py's exact workload (its arrivals and mix regenerated from the
   recorded run's seed, capacity and flags; its measured unloaded latencies as the SLO base) on 1
   encoder, 1 denoiser, 1 decoder with the recorded run's ``--capacity`` and ``--lower-class-places``;
   simulated goodput and attainment per window beside the measured ones (``--measured``, one or more
   goodput JSONs).
2. ``scale``: ``--denoisers`` denoisers (encoders and decoders sized so the denoisers are the
   bottleneck), the same mix with SLOs from the cost model's unloaded latencies; capacity = the
   requests/s answered in the second half of a window at 2x overload in FCFS; then ``--loads`` x capacity, slo and fcfs, each
   with ``--requests`` arrivals; goodput and attainment per class. The wall time of each run is
   printed (one core).
3. ``autoscale``: denoisers ``--scale-min``..``--denoisers`` under ``--step`` (offered load as
   fractions of the full pool's capacity, each for ``--step-s``); the autoscaler's instances over time.

    python benchmarks/simulate.py --out benchmarks/simulate.json --plot benchmarks/simulate.png

Parts may run apart (``--parts scale --out a.json`` ...) and be plotted together with ``--merge a.json b.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from triptych.core.kinds import Role  # noqa: E402
from triptych.deploy.config import AutoscaleConfig  # noqa: E402
from triptych.engine.config import EngineConfig  # noqa: E402
from triptych.sim.cluster import ClusterConfig  # noqa: E402
from triptych.sim.costs import CostModel  # noqa: E402
from triptych.sim.report import summarize  # noqa: E402
from triptych.sim.run import Arrival, closed_loop, simulate  # noqa: E402
from triptych.sim.workload import Spec, draw_specs, poisson_schedule  # noqa: E402


def serve_flag(serve: list[str], name: str, default: str) -> str:
    return serve[serve.index(name) + 1] if name in serve else default


def engine_from(serve: list[str]) -> tuple[int, EngineConfig]:
    """The ``--capacity`` and engine flags a recorded run's ``serve`` command had."""
    places = serve_flag(serve, "--lower-class-places", "none")
    engine = EngineConfig(lower_class_places=None if places == "none" else int(places))
    return int(serve_flag(serve, "--capacity", str(EngineConfig.max_batch_requests))), engine


# ---- 1. the check against a measured run ------------------------------------------------------
def check(costs: CostModel, measured_path: str) -> dict:
    m = json.loads(Path(measured_path).read_text())
    a = m["args"]
    capacity, engine = engine_from(m["serve"])
    config = ClusterConfig(capacity=capacity, engine=engine)
    rng = random.Random(a["seed"])
    sizes, steps = a["sizes"], a["steps"]

    def mix(n):
        return draw_specs(n, rng, sizes, steps, a["batch_share"], a["chat_share"])

    cap_specs = mix(10_000)  # goodput.py draws its capacity phase's mix first
    cap = m["capacity_rps"]
    # The calibrated variant: every stage's cost times f, f such that the simulated closed-loop
    # capacity (goodput.py's capacity phase: its clients, seconds and mix) is the measured one.
    sim_cap = closed_loop(costs, config, cap_specs, a["capacity_clients"], a["capacity_s"])
    factor = sim_cap / cap
    for _ in range(3):
        got = closed_loop(costs.scaled(factor), config, cap_specs, a["capacity_clients"], a["capacity_s"])
        factor *= got / cap
    calibrated = costs.scaled(factor)
    cal_cap = closed_loop(calibrated, config, cap_specs, a["capacity_clients"], a["capacity_s"])
    print(
        f"# check: measured capacity {cap:.2f} req/s, simulated {sim_cap:.2f}; costs x {factor:.2f} give {cal_cap:.2f}",
        flush=True,
    )
    base = {}
    for key, v in m["unloaded_s"].items():
        base[(0, 0) if key == "chat" else (int(key.split("x")[0]), int(key.split("/")[1]))] = v

    def slo_of(spec: Spec) -> float:
        factor = a["batch_slo_x"] if spec.cls == "batch" else a["interactive_slo_x"]
        return max(a["slo_floor_s"], factor * base[spec.shape])

    rows = []
    for x in a["loads"]:
        offsets = poisson_schedule(x * cap, a["window_s"], rng)
        specs = mix(len(offsets))
        arrivals = [Arrival(t, s, slo_of(s)) for t, s in zip(offsets, specs)]
        drain = a["drain_s"] if a["drain_s"] is not None else max(r.slo_s for r in arrivals) + 1.0
        for mode in ("slo", "fcfs"):
            sim = summarize(simulate(costs, config, arrivals, mode, drain)[0], a["window_s"])
            cal = summarize(simulate(calibrated, config, arrivals, mode, drain)[0], a["window_s"])
            real = next(w["summary"] for w in m["windows"] if w["load_x"] == x and w["mode"] == mode)
            rows.append(
                {"load_x": x, "rate_rps": x * cap, "mode": mode, "measured": real, "simulated": sim, "calibrated": cal}
            )
    return {
        "measured_file": measured_path,
        "capacity_rps": cap,
        "simulated_capacity_rps": sim_cap,
        "calibration_factor": factor,
        "calibrated_capacity_rps": cal_cap,
        "serve": m["serve"],
        "loadavg_measured": [w["loadavg"][0] for w in m["windows"]],
        "rows": rows,
    }


def ratio_line(c: dict) -> str:
    out = []
    for variant in ("measured", "simulated", "calibrated"):
        g = {(r["load_x"], r["mode"]): r[variant]["goodput_rps"] for r in c["rows"]}
        xs = dict.fromkeys(r["load_x"] for r in c["rows"])
        parts = [f"{x:g}x {g[(x, 'slo')] / g[(x, 'fcfs')]:.2f}" if g[(x, "fcfs")] else f"{x:g}x –" for x in xs]
        out.append(f"{variant}: " + ", ".join(parts))
    return "goodput slo / fcfs — " + "; ".join(out)


def check_table(c: dict) -> str:
    def att(s, cls):
        k = s["classes"].get(cls)
        return "–" if k is None else f"{k['attainment']:.0%}"

    out = [
        "| load | mode | goodput meas / sim / cal | interactive meas / sim / cal | batch meas / sim / cal"
        " | chat meas / sim / cal | 429 meas / sim / cal | 504 meas / sim / cal |",
        "|---" * 8 + "|",
    ]
    for r in c["rows"]:
        m, s, k = r["measured"], r["simulated"], r["calibrated"]

        def three(fn, m=m, s=s, k=k):
            return " / ".join(fn(v) for v in (m, s, k))

        out.append(
            f"| {r['load_x']:.1f}x | {r['mode']} | {three(lambda v: format(v['goodput_rps'], '.2f'))}"
            f" | {three(lambda v: att(v, 'interactive'))} | {three(lambda v: att(v, 'batch'))}"
            f" | {three(lambda v: att(v, 'chat'))} | {three(lambda v: str(v['refused_429']))}"
            f" | {three(lambda v: str(v['dropped_504']))} |"
        )
    return "\n".join(out) + "\n\n" + ratio_line(c)


# ---- 2. at scale --------------------------------------------------------------------------------
def mean_work(costs: CostModel, args) -> dict[str, float]:
    """Mean seconds of each stage's work per request of the mix (denoise at a full batch)."""
    shapes = [(s, n) for s in args.sizes for n in args.steps]
    den = sum(n * costs.tick((s, s), 8) / 8 for s, n in shapes) / len(shapes)
    dec = sum(costs.decode_s[(s, s)] for s, _ in shapes) / len(shapes)
    return {"encode": costs.encode_s + args.chat_share * costs.chat_s, "denoise": den, "decode": dec}


def scale_config(
    costs: CostModel, args, denoisers: int, autoscale: AutoscaleConfig | None = None, most: int | None = None
) -> ClusterConfig:
    """``denoisers`` to start with; encoders and decoders sized for ``most`` denoisers (default: that many)."""
    most = most or denoisers
    w = mean_work(costs, args)
    head = 1.5  # encoders and decoders with headroom: the denoisers are the bottleneck
    return ClusterConfig(
        encoders=max(1, math.ceil(most * w["encode"] / w["denoise"] * head)),
        denoisers=denoisers,
        decoders=max(1, math.ceil(most * w["decode"] / w["denoise"] * head)),
        capacity=args.capacity,
        engine=EngineConfig(lower_class_places=0),
        max_queued_requests=64 * most,
        max_queued=64 * most,
        autoscale=autoscale,
    )


def arrivals_for(costs: CostModel, args, rates: list[tuple[float, float]], rng: random.Random) -> list[Arrival]:
    """Piecewise Poisson: ``rates`` is (requests/s, seconds) per phase, back to back."""
    out, t0 = [], 0.0
    for rate, seconds in rates:
        offsets = poisson_schedule(rate, seconds, rng) if rate > 0 else []
        specs = draw_specs(len(offsets), rng, args.sizes, args.steps, args.batch_share, args.chat_share)
        for t, s in zip(offsets, specs):
            base = costs.chat_s if s.cls == "chat" else costs.unloaded_s((s.size, s.size), s.steps)
            factor = args.batch_slo_x if s.cls == "batch" else args.interactive_slo_x
            out.append(Arrival(t0 + t, s, max(args.slo_floor_s, factor * base)))
        t0 += seconds
    return out


def scale(costs: CostModel, args) -> dict:
    rng = random.Random(args.seed)
    config = scale_config(costs, args, args.denoisers)
    guess = args.denoisers / mean_work(costs, args)["denoise"]
    t = time.perf_counter()
    seconds = max(5.0, min(args.capacity_s, args.requests / (2 * guess)))  # about --requests arrivals
    arrivals = arrivals_for(costs, args, [(2 * guess, seconds)], rng)
    records, _ = simulate(costs, config, arrivals, "fcfs", 0.0)
    # answered in the window's second half (past the ramp from an empty cluster)
    cap = sum(r.status == 200 and a.t + r.latency_s >= seconds / 2 for r, a in zip(records, arrivals)) / (seconds / 2)
    print(
        f"# scale: {config.encoders}/{config.denoisers}/{config.decoders} workers, capacity {cap:.1f} req/s "
        f"(FCFS at 2x; {len(records)} requests in {time.perf_counter() - t:.0f}s wall)",
        flush=True,
    )
    points = []
    for x in args.loads:
        duration = args.requests / (x * cap)
        arrivals = arrivals_for(costs, args, [(x * cap, duration)], rng)
        drain = max(a.slo_s for a in arrivals) + 1.0
        for mode in ("slo", "fcfs"):
            t = time.perf_counter()
            records, cluster = simulate(costs, config, arrivals, mode, drain)
            wall = time.perf_counter() - t
            s = summarize(records, duration)
            pre = sum(d.preemptions for d in cluster.denoisers())
            points.append(
                {
                    "load_x": x,
                    "rate_rps": x * cap,
                    "mode": mode,
                    "duration_s": duration,
                    "wall_s": wall,
                    "events": cluster.loop.events,
                    "preemptions": pre,
                    "summary": s,
                }
            )
            print(
                f"# {x:.2f}x {mode}: {s['sent']} requests, goodput {s['goodput_rps']:.1f} req/s, "
                f"attainment {s['attainment']:.0%}, 429 {s['refused_429']}, 504 {s['dropped_504']}, "
                f"{wall:.0f}s wall, {cluster.loop.events} events",
                flush=True,
            )
    return {
        "capacity_rps": cap,
        "workers": [config.encoders, config.denoisers, config.decoders],
        "capacity_per_worker": args.capacity,
        "points": points,
    }


def scale_table(sc: dict) -> str:
    out = [
        "| load | offered req/s | mode | requests | goodput req/s | attainment | interactive | batch | chat"
        " | p99 interactive s | 429 | 504 | preemptions | wall s |",
        "|---" * 14 + "|",
    ]
    for p in sc["points"]:
        s, c = p["summary"], p["summary"]["classes"]

        def att(cls, c=c):
            return f"{c[cls]['attainment']:.1%}" if cls in c else "–"

        p99 = c.get("interactive", {}).get("p99_s")
        out.append(
            f"| {p['load_x']:.2f}x | {p['rate_rps']:.0f} | {p['mode']} | {s['sent']} | {s['goodput_rps']:.1f}"
            f" | {s['attainment']:.1%} | {att('interactive')} | {att('batch')} | {att('chat')}"
            f" | {'–' if p99 is None else f'{p99:.2f}'} | {s['refused_429']} | {s['dropped_504']}"
            f" | {p['preemptions']} | {p['wall_s']:.0f} |"
        )
    return "\n".join(out)


# ---- 3. the autoscaler under a load step ------------------------------------------------------
def autoscale(costs: CostModel, args, cap: float) -> dict:
    rng = random.Random(args.seed + 1)
    scaler = AutoscaleConfig(pools=(f"denoiser={args.scale_min}:{args.scale_max}",))
    config = scale_config(costs, args, args.scale_min, scaler, args.scale_max)
    phases = [(f * cap, args.step_s) for f in args.step]
    arrivals = arrivals_for(costs, args, phases, rng)
    t = time.perf_counter()
    records, cluster = simulate(costs, config, arrivals, "slo", args.step_s)
    wall = time.perf_counter() - t
    samples = [(s.t, s.instances, s.queue_depth) for s in cluster.autoscaler.samples if s.role == Role.DENOISER]
    events = [(t, e, iid) for t, role, e, iid in cluster.autoscaler.events]
    per_phase = []
    for i, (rate, seconds) in enumerate(phases):
        lo, hi = i * seconds, (i + 1) * seconds
        rs = [r for r, a in zip(records, arrivals) if lo <= a.t < hi]
        inst = [n for t, n, _ in samples if lo <= t < hi]
        s = summarize(rs, seconds)
        per_phase.append(
            {
                "offered_x": args.step[i],
                "rate_rps": rate,
                "summary": s,
                "instances_mean": sum(inst) / len(inst) if inst else None,
                "instances_max": max(inst, default=None),
            }
        )
        print(
            f"# autoscale phase {i}: {args.step[i]:.2f}x ({rate:.0f} req/s), goodput {s['goodput_rps']:.1f}, "
            f"attainment {s['attainment']:.0%}, denoisers mean {per_phase[-1]['instances_mean']:.1f} "
            f"max {per_phase[-1]['instances_max']}",
            flush=True,
        )
    print(f"# autoscale: {len(arrivals)} requests, {len(events)} scaling events, {wall:.0f}s wall", flush=True)
    return {
        "bounds": [args.scale_min, args.denoisers],
        "startup_s": config.startup_s,
        "config": vars(scaler),
        "phases": per_phase,
        "samples": samples,
        "events": events,
        "wall_s": wall,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    rows = result["check"]["rows"]
    for mode, style in (("slo", "o"), ("fcfs", "s")):
        rs = [r for r in rows if r["mode"] == mode]
        x = [r["rate_rps"] for r in rs]
        ax.plot(x, [r["measured"]["goodput_rps"] for r in rs], style + "-", label=f"{mode} measured")
        ax.plot(x, [r["simulated"]["goodput_rps"] for r in rs], style + "--", label=f"{mode} simulated")
        ax.plot(x, [r["calibrated"]["goodput_rps"] for r in rs], style + ":", label=f"{mode} simulated, calibrated")
    ax.set_xlabel("offered load, requests/s")
    ax.set_ylabel("goodput, requests/s within SLO")
    ax.set_title("1 encoder / 1 denoiser / 1 decoder: simulated vs measured")
    ax.legend(fontsize=8)
    ax = axes[1]
    sc = result["scale"]
    for mode in ("slo", "fcfs"):
        ps = [p for p in sc["points"] if p["mode"] == mode]
        ax.plot([p["load_x"] for p in ps], [p["summary"]["goodput_rps"] for p in ps], "o-", label=f"{mode} goodput")
    ax.plot(
        [p["load_x"] for p in sc["points"][::2]],
        [p["rate_rps"] for p in sc["points"][::2]],
        ":",
        color="grey",
        label="offered",
    )
    ax.set_xlabel("offered load, x capacity")
    ax.set_ylabel("goodput, requests/s")
    ax.set_title(f"{sc['workers'][1]} denoisers (simulated)")
    ax.legend(fontsize=8)
    ax = axes[2]
    au = result["autoscale"]
    ts = [s[0] for s in au["samples"]]
    ax.step(ts, [s[1] for s in au["samples"]], where="post", label="denoisers (live + starting)")
    ax.set_xlabel("virtual time, s")
    ax.set_ylabel("instances")
    ax2 = ax.twinx()
    edges, load = [], []
    for i, p in enumerate(au["phases"]):
        edges += [i * result["args"]["step_s"], (i + 1) * result["args"]["step_s"]]
        load += [p["rate_rps"]] * 2
    ax2.plot(edges, load, color="grey", ls=":", label="offered req/s")
    ax2.set_ylabel("offered requests/s")
    ax.set_title("autoscaler under a load step (simulated)")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def amain(args) -> dict:  # the router makes asyncio futures: it runs inside a loop, never awaiting
    costs = CostModel.load(args.costs)
    load0 = os.getloadavg()
    t = time.perf_counter()
    checks = [check(costs, p) for p in args.measured] if "check" in args.parts else []
    for c in checks:
        print(f"# check against {c['measured_file']}\n" + check_table(c), flush=True)
    sc = scale(costs, args) if "scale" in args.parts else None
    if sc is not None:
        print(scale_table(sc), flush=True)
    au = None
    if "autoscale" in args.parts:
        per = sc["capacity_rps"] / args.denoisers if sc else 1 / mean_work(costs, args)["denoise"]
        au = autoscale(costs, args, per * args.scale_max)
    return {
        "check": checks[0] if checks else None,
        "checks": checks,
        "scale": sc,
        "autoscale": au,
        "costs": args.costs,
        "args": vars(args),
        "total_s": time.perf_counter() - t,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--costs", default=str(ROOT / "benchmarks" / "sim_costs.json"))
    ap.add_argument("--measured", nargs="+", default=[str(ROOT / "benchmarks" / "goodput.json")])
    ap.add_argument("--denoisers", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=16, help="slots per worker")
    ap.add_argument("--requests", type=int, default=20_000, help="arrivals per load and mode at scale")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 1.0, 1.2, 1.5])
    ap.add_argument("--capacity-s", type=float, default=30.0, help="the overload run that measures capacity")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--batch-share", type=float, default=0.5)
    ap.add_argument("--chat-share", type=float, default=0.1)
    ap.add_argument("--interactive-slo-x", type=float, default=3.0)
    ap.add_argument("--batch-slo-x", type=float, default=15.0)
    ap.add_argument("--slo-floor-s", type=float, default=0.5)
    ap.add_argument("--scale-min", type=int, default=2, help="the autoscaled denoiser pool's lower bound")
    ap.add_argument("--scale-max", type=int, default=40, help="... and its upper bound")
    ap.add_argument("--step", type=float, nargs="+", default=[0.2, 0.9, 0.5, 1.1, 0.1], help="x capacity per phase")
    ap.add_argument("--step-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument(
        "--parts", nargs="+", default=["check", "scale", "autoscale"], choices=["check", "scale", "autoscale"]
    )
    ap.add_argument("--out", default="/tmp/simulate.json")
    ap.add_argument(
        "--merge", nargs="+", help="plot from these result JSONs (each with some --parts) instead of running"
    )
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "simulate.png"))
    args = ap.parse_args(argv)
    if args.merge:  # parts run apart (``--parts``), brought together for the plot
        result = {"check": None, "checks": [], "scale": None, "autoscale": None, "merged": args.merge}
        for path in args.merge:
            part = json.loads(Path(path).read_text())
            for k in ("check", "scale", "autoscale"):
                if part.get(k):
                    result[k] = part[k]
                    result[f"{k}_args"] = part["args"]
            result["checks"] += part.get("checks") or []
        result["args"] = result["autoscale_args"]
        if result["checks"]:
            result["check"] = result["checks"][0]  # the first measured file given
    else:
        result = asyncio.run(amain(args))
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(
            f"total {result['total_s']:.0f}s; load average at start {result['loadavg_start'][0]:.2f}, "
            f"at end {result['loadavg_end'][0]:.2f}"
        )
    if args.plot and all(result[k] for k in ("check", "scale", "autoscale")):
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
