"""Goodput under open-loop Poisson load: priorities and deadlines against first come, first served.

Issue 45 item 5. Starts ``triptych serve`` on 127.0.0.1 with the packaged default model (one
encoder, one denoiser, one decoder, one torch thread each, ZMQ transfer; its process group is ended
at the end) and drives it with an asyncio httpx client whose requests arrive on their own Poisson
clock, not when an earlier one returned (open loop).

Workload (seeded): each request is drawn independently — a class (``interactive``: priority 0 and
a tight ``deadline_s``; ``batch``: priority 10 and a loose one), a size (64x64 or 128x128) and a
step count (10 or 20); a share of the arrivals (``--chat-share``) are short chats (priority 0, no
deadline: chats take none; judged against the interactive SLO factor). A request's SLO is its
class's factor times the unloaded latency of its (size, steps) (or of a chat), measured one by one
at the start, and never under ``--slo-floor-s``; ``deadline_s`` is that SLO.

Serve flags (``--serve-args``, default ``PREEMPTION``): step-boundary preemption on
(``--lower-class-places 0``) and ``--capacity 16``; both modes share one server.

Phases: warm-up (every shape a few times, which also teaches the head its step costs), the
unloaded latencies, capacity (requests/s over ``--capacity-s`` of closed-loop load at
``--capacity-clients`` on the same mix), then for each rate multiple (default 0.5, 1.0, 1.2, 1.5 of
capacity) both modes, alternating which goes first: ``slo`` (priorities and deadlines sent) and
``fcfs`` (the same arrivals, every priority 0, no ``deadline_s``; latencies judged against the same
SLOs). Each window lasts ``--window-s``; the requests it sent are then awaited up to
``--drain-s`` after the last arrival (default: the longest SLO, so a request cut off had already
missed; the rest are cancelled), then the head's queue depth is awaited to reach 0 (work of a
cancelled request still running) and the server is left idle ``--idle-s`` before the next window.

Per window: goodput (requests/s of the window answered 200 within their SLO), SLO attainment per
class (within SLO / sent), p50/p99 latency of the 200s per class, refused (429) and dropped (504)
counts. Prints a markdown table, writes ``--out`` JSON and ``--plot`` (goodput against offered
load, both modes).

    python benchmarks/goodput.py --out /tmp/goodput.json --plot benchmarks/goodput.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
IMAGES = "/v1/images/generations"
CHATS = "/v1/chat/completions"
# Step-boundary preemption: an interactive request runs with its own class only (the batch class
# parked while it runs), and 16 slots per worker so queued batch work (the head holds a denoiser
# slot per request from its encode on) leaves an interactive request a slot. One server for both
# modes: FCFS sends every request at priority 0, so nothing is preempted there.
PREEMPTION = "--capacity 16 --lower-class-places 0"


# ---- pure parts: the workload and its summary, shared with the simulator (triptych.sim) ----------
from triptych.sim.report import Record, percentile, summarize  # noqa: E402
from triptych.sim.workload import CLASSES, PRIORITY, Spec, draw_specs, poisson_schedule  # noqa: E402

__all__ = ["CLASSES", "PRIORITY", "Record", "Spec", "draw_specs", "percentile", "poisson_schedule", "summarize"]


# ---- the server ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``triptych serve`` in its own process group on a free loopback port."""

    def __init__(self, model: str, tmp: str, extra: list[str]):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", model, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--threads", "1", "--transfer", "zmq", "--data-dir", f"{tmp}/data", *extra]
        self.cmd = cmd
        self.log_path = Path(tmp) / "serve.log"
        log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )

    def wait(self, timeout_s: float) -> None:
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"serve not healthy in {timeout_s}s; see {self.log_path}")

    def stop(self) -> None:
        pgid = self.proc.pid  # start_new_session: the group's id is the leader's pid
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            try:  # the leader is gone: any worker left in the group goes too
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


# ---- the client ---------------------------------------------------------------------------------
class Client:
    def __init__(self, base: str, run_id: str):
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=base, timeout=None, limits=limits)
        self.run_id, self.counter = run_id, 0

    def body(self, spec: Spec, mode: str, slo_s: float | None) -> tuple[str, dict]:
        self.counter += 1
        i = self.counter  # a fresh prompt and seed each time: nothing comes from the result cache
        if spec.cls == "chat":
            b = {
                "messages": [{"role": "user", "content": f"Name one colour. ({self.run_id}-{i})"}],
                "max_tokens": 8,
                "seed": i,
            }
            return CHATS, b
        b = {
            "prompt": f"object {self.run_id}-{i} on a plain background",
            "size": f"{spec.size}x{spec.size}",
            "num_inference_steps": spec.steps,
            "seed": i,
            "response_format": "b64_json",
        }
        if mode == "slo":
            b["priority"] = PRIORITY[spec.cls]
            if slo_s is not None:
                b["deadline_s"] = round(slo_s, 3)
        return IMAGES, b

    async def send(self, spec: Spec, mode: str, slo_s: float | None) -> tuple[int, float]:
        route, b = self.body(spec, mode, slo_s)
        t = time.perf_counter()
        r = await self.http.post(route, json=b)
        await r.aread()
        return r.status_code, time.perf_counter() - t

    async def wait_idle(self, timeout_s: float) -> float:
        """Seconds until the head reports no admitted, unfinished job (``triptych_queue_depth{stage="head"}``
        0; a cancelled request the server still runs counts), at most ``timeout_s``."""
        t = time.perf_counter()
        while time.perf_counter() - t < timeout_s:
            text = (await self.http.get("/metrics")).text
            depth = [
                float(ln.split()[-1])
                for ln in text.splitlines()
                if ln.startswith("triptych_queue_depth{") and 'stage="head"' in ln
            ]
            if sum(depth) == 0:  # also when the series is missing: nothing to wait for
                break
            await asyncio.sleep(0.5)
        return time.perf_counter() - t

    async def close(self) -> None:
        await self.http.aclose()


async def unloaded(client: Client, shapes: list[Spec], repeats: int) -> dict[tuple[int, int], float]:
    """Median latency of each shape sent alone (one at a time)."""
    out = {}
    for spec in shapes:
        times = []
        for _ in range(repeats):
            status, lat = await client.send(spec, "fcfs", None)
            if status != 200:
                raise RuntimeError(f"unloaded {spec}: HTTP {status}")
            times.append(lat)
        out[spec.shape] = percentile(times, 0.5)
    return out


async def capacity(client: Client, specs: list[Spec], clients: int, seconds: float) -> float:
    """Requests/s the server completes with ``clients`` sending back to back (the mix, FCFS)."""
    done, end, it = 0, time.perf_counter() + seconds, iter(specs)
    t0 = time.perf_counter()

    async def one():
        nonlocal done
        while time.perf_counter() < end:
            status, _ = await client.send(next(it), "fcfs", None)
            done += status == 200

    await asyncio.gather(*(one() for _ in range(clients)))
    return done / (time.perf_counter() - t0)


async def window(
    client: Client, arrivals: list[float], specs: list[Spec], slos: list[float], mode: str, drain_s: float
):
    """Send ``specs[k]`` at ``arrivals[k]`` (open loop); each latency from its scheduled time."""
    t0 = time.perf_counter()
    records: list[Record | None] = [None] * len(arrivals)

    async def one(k: int):
        delay = t0 + arrivals[k] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sched = t0 + arrivals[k]
        deadline = slos[k] if specs[k].cls != "chat" else None
        try:
            status, _ = await client.send(specs[k], mode, deadline)
        except Exception:  # noqa: BLE001 - a transport failure is a failed request, recorded
            status = -1
        records[k] = Record(specs[k].cls, status, time.perf_counter() - sched, slos[k])

    tasks = [asyncio.create_task(one(k)) for k in range(len(arrivals))]
    horizon = (arrivals[-1] if arrivals else 0.0) + drain_s
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + horizon - time.perf_counter()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for k, r in enumerate(records):
        if r is None:  # no answer before the drain ended
            records[k] = Record(specs[k].cls, 0, time.perf_counter() - (t0 + arrivals[k]), slos[k])
    return records, time.perf_counter() - t0


# ---- report -------------------------------------------------------------------------------------
def fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(result: dict) -> str:
    head = (
        "| load | offered req/s | mode | sent | goodput req/s | attainment interactive | attainment batch"
        " | attainment chat | p50 / p99 interactive s | p50 / p99 batch s | p50 / p99 chat s | 429 | 504 |"
    )
    out = [head, "|---" * 13 + "|"]
    for w in result["windows"]:
        c = w["summary"]["classes"]

        def att(cls, c=c):
            return f"{c[cls]['attainment']:.0%} ({c[cls]['good']}/{c[cls]['sent']})" if cls in c else "–"

        def lat(cls, c=c):
            return f"{fmt(c[cls]['p50_s'], '.1f')} / {fmt(c[cls]['p99_s'], '.1f')}" if cls in c else "–"

        s = w["summary"]
        out.append(
            f"| {w['load_x']:.1f}x | {w['rate_rps']:.2f} | {w['mode']} | {s['sent']} | {s['goodput_rps']:.3f}"
            f" | {att('interactive')} | {att('batch')} | {att('chat')} | {lat('interactive')} | {lat('batch')}"
            f" | {lat('chat')} | {s['refused_429']} | {s['dropped_504']} |"
        )
    return "\n".join(out)


def ratios(result: dict) -> dict[str, float | None]:
    """Per load: the slo mode's goodput over fcfs's."""
    g = {(w["load_x"], w["mode"]): w["summary"]["goodput_rps"] for w in result["windows"]}
    out = {}
    for x in dict.fromkeys(w["load_x"] for w in result["windows"]):
        f = g.get((x, "fcfs"))
        out[f"{x:g}"] = g[(x, "slo")] / f if f else None
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("slo", "priorities + deadlines"), ("fcfs", "FCFS")):
        ws = [w for w in result["windows"] if w["mode"] == mode]
        ax.plot([w["rate_rps"] for w in ws], [w["summary"]["goodput_rps"] for w in ws], "o-", label=label)
    top = max(w["rate_rps"] for w in result["windows"])
    ax.plot([0, top], [0, top], ":", color="grey", label="offered")
    ax.axvline(result["capacity_rps"], color="grey", ls="--", lw=0.8, label="capacity (closed loop)")
    ax.set_xlabel("offered load, requests/s (Poisson)")
    ax.set_ylabel("goodput, requests/s within SLO")
    ax.set_title("Goodput under open-loop load (default model, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- main ---------------------------------------------------------------------------------------
async def run(args, server: Server) -> dict:
    rng = random.Random(args.seed)
    client = Client(server.base, f"g{args.seed}")
    sizes, steps = args.sizes, args.steps
    try:
        shapes = [Spec("interactive", s, n) for s in sizes for n in steps]
        chat = [Spec("chat", 0, 0)] if args.chat_share > 0 else []
        t = time.perf_counter()
        for _ in range(args.warmup):
            for spec in shapes + chat:
                await client.send(spec, "fcfs", None)
        base = await unloaded(client, shapes + chat, args.unloaded_repeats)
        warm_s = time.perf_counter() - t
        print(
            f"# unloaded latency: { {f'{k[0]}x{k[0]}/{k[1]}' if k[0] else 'chat': round(v, 3) for k, v in base.items()} }"
        )
        mix = lambda n: draw_specs(n, rng, sizes, steps, args.batch_share, args.chat_share)  # noqa: E731
        cap = await capacity(client, mix(10_000), args.capacity_clients, args.capacity_s)
        print(f"# capacity: {cap:.3f} req/s closed loop at {args.capacity_clients} clients", flush=True)
        await asyncio.sleep(args.idle_s)

        def slo_of(spec: Spec) -> float:
            factor = args.batch_slo_x if spec.cls == "batch" else args.interactive_slo_x
            return max(args.slo_floor_s, factor * base[spec.shape])

        windows = []
        for i, x in enumerate(args.loads):
            rate = x * cap
            arrivals = poisson_schedule(rate, args.window_s, rng)
            specs = mix(len(arrivals))
            slos = [slo_of(s) for s in specs]
            order = ("slo", "fcfs") if i % 2 == 0 else ("fcfs", "slo")
            for mode in order:
                load0 = os.getloadavg()
                drain = args.drain_s if args.drain_s is not None else max(slos, default=0.0) + 1.0
                records, span = await window(client, arrivals, specs, slos, mode, drain)
                summary = summarize(records, args.window_s)
                w = {"load_x": x, "rate_rps": rate, "mode": mode, "span_s": span, "loadavg": os.getloadavg()}
                w |= {"loadavg_before": load0, "summary": summary, "records": [asdict(r) for r in records]}
                windows.append(w)
                print(
                    f"# {x:.1f}x {mode}: {summary['sent']} sent, goodput {summary['goodput_rps']:.3f} req/s, "
                    f"429 {summary['refused_429']}, 504 {summary['dropped_504']}, span {span:.0f}s, "
                    f"load average {w['loadavg'][0]:.2f}",
                    flush=True,
                )
                w["idle_wait_s"] = await client.wait_idle(120)
                await asyncio.sleep(args.idle_s)
        return {
            "unloaded_s": {f"{k[0]}x{k[0]}/{k[1]}" if k[0] else "chat": v for k, v in base.items()},
            "warmup_s": warm_s,
            "capacity_rps": cap,
            "windows": windows,
        }
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 1.2, 1.5], help="rates, x capacity")
    ap.add_argument("--window-s", type=float, default=30.0, help="arrival window per rate and mode")
    ap.add_argument(
        "--drain-s",
        type=float,
        default=None,
        help="wait after the last arrival (default: the longest SLO); the rest miss",
    )
    ap.add_argument("--idle-s", type=float, default=2.0, help="pause between windows")
    ap.add_argument("--capacity-s", type=float, default=20.0, help="closed-loop capacity measurement")
    ap.add_argument("--capacity-clients", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--batch-share", type=float, default=0.5, help="share of image requests in the batch class")
    ap.add_argument("--chat-share", type=float, default=0.1, help="share of arrivals that are chats")
    ap.add_argument("--interactive-slo-x", type=float, default=3.0, help="SLO: x the shape's unloaded latency")
    ap.add_argument("--batch-slo-x", type=float, default=15.0, help="SLO: x the shape's unloaded latency")
    ap.add_argument("--slo-floor-s", type=float, default=0.5, help="no SLO shorter than this")
    ap.add_argument("--warmup", type=int, default=2, help="rounds of every shape before measuring")
    ap.add_argument("--unloaded-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument(
        "--serve-args",
        default=PREEMPTION,
        help="extra `triptych serve` arguments (one string; default: preemption on, see PREEMPTION)",
    )
    ap.add_argument("--out", default="/tmp/goodput.json")
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "goodput.png"))
    args = ap.parse_args(argv)
    from triptych.families.models import default_model_dir

    model = str(default_model_dir())
    tmp = tempfile.mkdtemp(prefix="goodput-")
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a TERM still ends the server's group
    server = Server(model, tmp, args.serve_args.split())
    try:
        server.wait(600)
        started_s = time.perf_counter() - t0
        result = asyncio.run(run(args, server))
    finally:
        server.stop()
    result |= {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "serve": server.cmd,
        "args": vars(args),
        "start_s": started_s,
        "total_s": time.perf_counter() - t0,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "goodput_ratio_slo_over_fcfs": ratios(result),
    }
    print(table(result))
    r = result["goodput_ratio_slo_over_fcfs"]
    print("\ngoodput slo / fcfs: " + ", ".join(f"{x}x: {fmt(v)}" for x, v in r.items()))
    la, lb = result["loadavg_start"], result["loadavg_end"]
    print(
        f"load average (1/5/15 min) at start {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f}, at end {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f}"
    )
    print(f"capacity {result['capacity_rps']:.3f} req/s; total {result['total_s']:.0f}s")
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
