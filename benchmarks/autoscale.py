"""Autoscaling under a load step: instances and queue depth over time.

Starts the embedded server in this process (head + local worker processes, or Ray actors with
``--cluster ray``) with ``--autoscale ROLE=MIN:MAX``, offers open-loop Poisson arrivals in phases
(``--phases SECONDS:RATE ...``, e.g. quiet, busy, quiet), and samples every 0.25 s: the role's
registered instances, the instances the autoscaler counts (registered + starting), and the requests
waiting for the role. Writes ``OUT.json`` (samples, scaling events, every request's outcome and
latency) and ``OUT.png`` (instances and queue depth over time, arrival rate shaded), and prints a
summary: time from the first queue to the first added instance registering, time from the end of
the load to the pool back at MIN, requests failed.

    python benchmarks/autoscale.py --phases 8:0.5 40:8 30:0.5 --autoscale denoiser=1:3 --out benchmarks/autoscale
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from triptych.control.backend import GenerationJob  # noqa: E402
from triptych.control.orchestrator import OrchestratorConfig  # noqa: E402
from triptych.deploy.config import AutoscaleConfig, ClusterConfig  # noqa: E402
from triptych.deploy.launch import EmbeddedBackend, TopologyConfig  # noqa: E402
from triptych.families.base import GenerationParams  # noqa: E402
from triptych.families.registry import load_family, make_tiny  # noqa: E402


def backend_for(args, model: str, scale: AutoscaleConfig):
    """The backend, and the function that stops what it started besides (Ray; a no-op locally)."""
    topology = TopologyConfig(transfer="zmq", capacity=args.capacity, torch_threads=1)
    config = OrchestratorConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=10.0, max_queued=4096)
    pool, stop = {}, lambda: None
    if args.cluster == "ray":
        from triptych.deploy.ray_backend import RayWorkers, ray_pool

        cluster = ClusterConfig(cluster="ray")
        factory, stop = ray_pool(cluster, topology, scale)
        assert factory.func is RayWorkers
        pool = {"pool": factory}
    return EmbeddedBackend(model, config, topology, autoscale=scale, **pool), stop


async def run(args) -> dict:
    model = args.model or str(make_tiny("flux", tempfile.mkdtemp(prefix="autoscale-"), seed=0))
    family = load_family(model)
    scale = AutoscaleConfig(
        pools=(args.autoscale,), up_queue=args.up_queue, up_wait_s=args.up_wait_s, down_idle_s=args.down_idle_s
    )
    role = args.autoscale.split("=")[0]
    backend, stop = backend_for(args, model, scale)
    started = time.monotonic()
    await backend.start()
    start_s = time.monotonic() - started
    rng = random.Random(0)
    t0 = time.monotonic()
    samples, requests, tasks = [], [], []

    async def one(i: int) -> None:
        params = family.resolve(GenerationParams(f"object {i}", seed=i, steps=args.steps, height=64, width=64))
        start = time.monotonic()
        try:
            await backend.run(GenerationJob(f"r{i}", params, "png"))
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - every failure is a result here, reported by type
            outcome = type(e).__name__
        requests.append({"i": i, "sent": start - t0, "latency": time.monotonic() - start, "outcome": outcome})

    async def sample() -> None:
        while True:
            now = time.monotonic()
            load = backend.orchestrator.load(role, now)
            counted = backend.autoscaler.samples[-1].instances if backend.autoscaler.samples else len(load.live)
            backlog = sum(n for n, _ in backend.orchestrator.generations.backlog(now).values())
            samples.append(
                {
                    "t": now - t0,
                    "registered": len(load.live),
                    "counted": counted,
                    "queue": load.queue_depth,
                    "backlog": backlog,
                }
            )
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    i, phase_end, phases = 0, 0.0, []
    for spec in args.phases:
        seconds, rate = (float(x) for x in spec.split(":"))
        start, phase_end = phase_end, phase_end + seconds
        phases.append({"start": start, "end": phase_end, "rate": rate})
        while (now := time.monotonic() - t0) < phase_end:
            gap = rng.expovariate(rate) if rate > 0 else phase_end - now
            await asyncio.sleep(min(gap, phase_end - now))
            if rate > 0 and time.monotonic() - t0 < phase_end:
                tasks.append(asyncio.create_task(one(i)))
                i += 1
    await asyncio.gather(*tasks)
    lo, hi = scale.bounds()[role]
    done = time.monotonic()
    while len(backend.orchestrator.load(role, time.monotonic()).live) > lo and time.monotonic() - done < 60 + (
        hi - lo
    ) * (scale.down_idle_s + 5):
        await asyncio.sleep(0.25)
    await asyncio.sleep(1.0)
    sampler.cancel()
    events = [(t - t0, r, kind, iid) for t, r, kind, iid in backend.autoscaler.events]
    await backend.close()
    stop()
    return {
        "phases": phases,
        "samples": samples,
        "events": events,
        "requests": requests,
        "role": role,
        "start_s": start_s,
    }


def summarize(result: dict) -> dict:
    """Scale-out delay (each add → that instance registered), time back at MIN vs the last answer."""
    s, ev = result["samples"], result["events"]
    start_n = s[0]["registered"] if s else 0
    ups = [b["t"] for a, b in zip(s, s[1:]) if b["registered"] > a["registered"]]
    adds = [t for t, _, k, _ in ev if k == "add"]
    peak = max((x["registered"] for x in s), default=0)
    peak_t = next((x["t"] for x in s if x["registered"] == peak), 0.0)
    back = next((x["t"] for x in s if x["t"] > peak_t and x["registered"] == start_n), None)
    ok = sorted(r["latency"] for r in result["requests"] if r["outcome"] == "ok")
    done = max((r["sent"] + r["latency"] for r in result["requests"]), default=None)
    return {
        "server_start_s": result["start_s"],
        "requests": len(result["requests"]),
        "failed": sum(r["outcome"] != "ok" for r in result["requests"]),
        "latency_p50_s": ok[len(ok) // 2] if ok else None,
        "latency_max_s": ok[-1] if ok else None,
        "peak_instances": peak,
        "first_add_s": adds[0] if adds else None,
        "add_to_registered_s": [round(u - a, 1) for a, u in zip(adds, ups)],
        "last_answer_s": done,
        "back_to_min_s": back,
        "back_to_min_after_last_answer_s": None if back is None or done is None else back - done,
        "events": [f"{t:.1f}s {k} {iid}" for t, _, k, iid in ev],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for p in result["phases"]:
        ax.axvspan(p["start"], p["end"], color="tab:orange", alpha=min(0.35, 0.04 * p["rate"]), lw=0)
    t = [x["t"] for x in s]
    ax.step(t, [x["registered"] for x in s], where="post", label=f"{result['role']} instances registered", lw=2)
    ax.step(t, [x["counted"] for x in s], where="post", label="instances counted (incl. starting)", ls="--")
    ax.set_xlabel("seconds")
    ax.set_ylabel("instances")
    ax2 = ax.twinx()
    ax2.plot(
        t, [x["backlog"] for x in s], color="tab:gray", alpha=0.7, label="requests waiting at the head (any stage)"
    )
    ax2.plot(t, [x["queue"] for x in s], color="tab:red", alpha=0.6, label=f"requests waiting for a {result['role']}")
    ax2.set_ylabel("queue depth")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [x.get_label() for x in lines], loc="upper right", fontsize=8)
    rates = ", ".join(f"{p['rate']:g}/s for {p['end'] - p['start']:g}s" for p in result["phases"])
    ax.set_title(f"autoscale {result['role']}: Poisson arrivals {rates} (shaded)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: tiny seeded FLUX)")
    ap.add_argument("--cluster", choices=["local", "ray"], default="local")
    ap.add_argument("--autoscale", default="denoiser=1:3")
    ap.add_argument("--phases", nargs="+", default=["8:0.5", "40:8", "30:0.5"], help="SECONDS:RATE (req/s)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=2)
    ap.add_argument("--up-queue", type=int, default=4)
    ap.add_argument("--up-wait-s", type=float, default=2.0)
    ap.add_argument("--down-idle-s", type=float, default=5.0)
    ap.add_argument("--out", default="benchmarks/autoscale")
    ap.add_argument("--replot", help="redo the summary and plot of an earlier OUT.json (no run)")
    args = ap.parse_args()
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        result["summary"] = summarize(result)
        Path(args.replot).write_text(json.dumps(result, indent=1))
        plot(result, Path(args.replot).with_suffix(".png"))
        print(json.dumps(result["summary"], indent=1))
        return
    result = asyncio.run(run(args))
    result["summary"] = summarize(result)
    result["command"] = "python benchmarks/autoscale.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if v is not None
    )
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
