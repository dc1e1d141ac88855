"""An urgent image under a continuous low-priority flood, with step-boundary preemption on and off.

Issue 45's first "done when": under a continuous low-priority flood, a priority-0 image's latency
is at most 1.5x its idle latency. Starts ``triptych serve`` on 127.0.0.1 with the packaged default
model (one encoder, one denoiser, one decoder, one torch thread each, ZMQ transfer, ``--capacity``
slots per worker so the flood leaves the urgent request a slot; its process group is ended at the
end), once per mode, the modes alternating over ``--rounds``:

- ``on``: ``--lower-class-places 0`` (an urgent request runs with its own class only, the flood
  preempted and parked while it runs);
- ``off``: ``--lower-class-places none`` (the default: the urgent request takes a place in the
  flood's batch at the next step boundary, nothing parked).

Each round: warm-up, the urgent image's idle latency (``--probes`` sent one at a time), then
``--flood`` closed-loop clients send priority-10 images of ``--flood-steps`` steps back to back
while the same urgent image (priority 0, ``--steps`` steps, a fresh prompt and seed each time) is
sent ``--probes`` times, one at a time, ``--gap-s`` apart, after ``--ramp-s``. Reports per mode
the median idle and loaded latency and their ratio, the flood's completed images, and the
denoiser's preemption counter from ``/metrics``.

    python benchmarks/preemption.py --out /tmp/preemption.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput import Server  # noqa: E402 - the same server wrapper, beside this file

IMAGES = "/v1/images/generations"
MODES = {"on": ["--lower-class-places", "0"], "off": ["--lower-class-places", "none"]}


def body(tag: str, i: int, size: int, steps: int, priority: int) -> dict:
    return {
        "prompt": f"object {tag}-{i} on a plain background",  # fresh each time: no result cache involved
        "size": f"{size}x{size}",
        "num_inference_steps": steps,
        "seed": i,
        "priority": priority,
        "response_format": "b64_json",
    }


async def post(http, b: dict) -> tuple[int, float]:
    t = time.perf_counter()
    r = await http.post(IMAGES, json=b)
    await r.aread()
    return r.status_code, time.perf_counter() - t


def metric(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


async def round_of(base: str, mode: str, args) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as http:
        counter = iter(range(1, 10**9))

        async def urgent(tag: str) -> float:
            status, lat = await post(http, body(f"{mode}-{tag}", next(counter), args.size, args.steps, 0))
            if status != 200:
                raise RuntimeError(f"urgent image: HTTP {status}")
            return lat

        for _ in range(args.warmup):
            await urgent("warm")
            await post(http, body(f"{mode}-warm-flood", next(counter), args.size, args.flood_steps, 10))
        idle = [await urgent("idle") for _ in range(args.probes)]
        stop, flood_done = asyncio.Event(), []

        async def flood_client():
            while not stop.is_set():
                status, _ = await post(http, body(f"{mode}-flood", next(counter), args.size, args.flood_steps, 10))
                if not stop.is_set():
                    flood_done.append(status)

        before = metric((await http.get("/metrics")).text, "triptych_denoiser_preemptions_total")
        clients = [asyncio.create_task(flood_client()) for _ in range(args.flood)]
        await asyncio.sleep(args.ramp_s)
        loaded = []
        for _ in range(args.probes):
            loaded.append(await urgent("loaded"))
            await asyncio.sleep(args.gap_s)
        text = (await http.get("/metrics")).text
        stop.set()
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    idle_s, loaded_s = statistics.median(idle), statistics.median(loaded)
    return {
        "mode": mode,
        "idle_s": idle,
        "loaded_s": loaded,
        "idle_median_s": idle_s,
        "loaded_median_s": loaded_s,
        "ratio": loaded_s / idle_s,
        "flood_images_done": sum(s == 200 for s in flood_done),
        "flood_errors": sum(s != 200 for s in flood_done),
        "preemptions": metric(text, "triptych_denoiser_preemptions_total") - before,
        "parked_bytes_at_end": metric(text, "triptych_denoiser_parked_bytes{"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "triptych" / "assets" / "default"))
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode, the modes alternating")
    ap.add_argument("--capacity", type=int, default=16, help="slots per worker (more than the flood)")
    ap.add_argument("--flood", type=int, default=12, help="closed-loop low-priority clients")
    ap.add_argument("--flood-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=20, help="the urgent image's steps")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--probes", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ramp-s", type=float, default=4.0)
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results, commands = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                Path(f"{tmp}/{mode}{r}").mkdir()
                server = Server(args.model, f"{tmp}/{mode}{r}", ["--capacity", str(args.capacity), *MODES[mode]])
                commands[mode] = server.cmd
                try:
                    server.wait(180)
                    load = os.getloadavg()[0]
                    res = asyncio.run(round_of(server.base, mode, args))
                    res.update(round=r, load_start=load, load_end=os.getloadavg()[0])
                finally:
                    server.stop()
                results.append(res)
                print(
                    f"round {r} {mode}: idle {res['idle_median_s']:.3f}s loaded {res['loaded_median_s']:.3f}s "
                    f"ratio {res['ratio']:.2f} flood done {res['flood_images_done']} "
                    f"preemptions {res['preemptions']:.0f} load {res['load_start']:.2f}->{res['load_end']:.2f}",
                    flush=True,
                )
    for mode in ("on", "off"):
        mine = [x for x in results if x["mode"] == mode]
        ratios = [x["ratio"] for x in mine]
        print(
            f"{mode}: ratio per round {', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "serve": commands, "rounds": results}, indent=1)
        )


if __name__ == "__main__":
    main()
