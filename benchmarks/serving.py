"""Serving benchmark: Triptych's pools against in-process diffusers and a naive FastAPI server.

Systems, all on the same seeded weights (tiny FLUX by default, 64x64), one torch thread per process:
- ``inproc``: diffusers' own pipeline called sequentially in this process (open-loop arrivals wait
  in a FIFO for the one pipeline);
- ``naive``: a minimal FastAPI + diffusers server (one pipeline behind an asyncio lock, the same
  OpenAI-style route), started from this script in a subprocess;
- ``t111`` / ``t121``: ``triptych serve`` with 1 encoder, 1 (or 2) denoisers, 1 decoder as local
  worker processes (ZMQ transfer); ``r121``: the same 1:2:1 as Ray actors (``--cluster ray``, a Ray
  instance started by the server on loopback; its CPU counts Ray's own processes too).

Per repeat the systems alternate (order rotated), each warmed up first: single requests one at a
time (latency vs ``inproc``: target 1:1:1 <= 1.10x), single requests at larger sizes (cost vs image
size), and open-loop Poisson arrivals at each ``--rates`` for ``--duration`` seconds (throughput,
p50/p95/p99 latency). For Triptych, the ``/metrics`` deltas of each run split the latency: time in
tensor transfers, time in the stages (encode/denoise/decode runs and queue waits at the head), and
the rest (HTTP, the head, control messages). Writes ``--out`` JSON and prints markdown tables.

    python benchmarks/serving.py --rates 1 2 4 --duration 12 --repeats 2 --out benchmarks/serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx  # noqa: E402

ROUTE = "/v1/images/generations"
TRIPTYCH = ("t111", "t121", "r121")  # the systems that are triptych serve (their /metrics split the latency)
ROLES = ("encoder", "denoiser", "decoder")


# ---- the naive baseline: one pipeline, one lock -------------------------------------------------
def naive_app(model: str, extra: dict):
    import torch
    from diffusers import DiffusionPipeline
    from fastapi import FastAPI

    torch.set_num_threads(1)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    lock = asyncio.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post(ROUTE)
    async def generate(body: dict):
        width, height = (int(x) for x in body.get("size", "64x64").split("x"))
        gen = torch.Generator("cpu").manual_seed(int(body.get("seed", 0)))
        kwargs = {"height": height, "width": width, "num_inference_steps": int(body["num_inference_steps"]), **extra}
        async with lock:
            out = await asyncio.to_thread(pipe, prompt=body["prompt"], generator=gen, **kwargs)
        buf = io.BytesIO()
        out.images[0].save(buf, format="PNG")
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(buf.getvalue()).decode()}]}

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on a free loopback port."""

    def __init__(self, name: str, cmd: list[str], tmp: str, cwd: str | Path | None = None):
        """``cwd``: the server's working directory. ``python -m`` puts it first on ``sys.path``, before
        ``PYTHONPATH``: a server meant to run another checkout must start in that checkout."""
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        log = open(Path(tmp) / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        cmd = [*cmd, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)

    def wait(self, timeout_s: float = 600) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(self.name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- clients -------------------------------------------------------------------------------------
def body(i: int, size: int, steps: int) -> dict:
    return {"prompt": f"object {i}", "size": f"{size}x{size}", "seed": i, "num_inference_steps": steps}


class InProc:
    """diffusers' pipeline in this process, one request at a time (a FIFO in front of it)."""

    name = "inproc"

    def __init__(self, model: str, extra: dict):
        import torch
        from diffusers import DiffusionPipeline

        torch.set_num_threads(1)
        self.torch = torch
        self.pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.lock = threading.Lock()
        self.extra = extra

    def _run(self, b: dict) -> None:
        size = int(b["size"].split("x")[0])
        gen = self.torch.Generator("cpu").manual_seed(b["seed"])
        with self.lock:
            self.pipe(
                prompt=b["prompt"],
                generator=gen,
                height=size,
                width=size,
                num_inference_steps=b["num_inference_steps"],
                **self.extra,
            )

    async def request(self, b: dict) -> float:
        t = time.perf_counter()
        await asyncio.to_thread(self._run, b)
        return time.perf_counter() - t

    def cpu(self) -> float:
        return time.process_time()


class Http:
    def __init__(self, server: Server):
        self.name, self.server = server.name, server
        self.client = httpx.AsyncClient(base_url=server.base, timeout=600)

    async def request(self, b: dict) -> float:
        t = time.perf_counter()
        r = await self.client.post(ROUTE, json=b)
        r.raise_for_status()
        return time.perf_counter() - t

    def cpu(self) -> float:
        """CPU seconds (user + system) of the server and every process under it (its workers)."""
        import psutil

        root = psutil.Process(self.server.proc.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                continue
        return total

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.server.base}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            m = re.match(
                r"^(triptych_(?:stage_run|queue_wait|transfer_latency)_seconds_(?:sum|count))(\{[^}]*\})? (\S+)$", line
            )
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out


def split(before: dict, after: dict, n: int, client_mean: float) -> dict:
    """Per-request seconds in transfers, in stages (runs + queue waits), and the rest, from /metrics deltas."""

    def total(prefix: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix) and "_sum" in k)

    transfer = total("triptych_transfer_latency_seconds_sum") / max(n, 1)
    stages = (total("triptych_stage_run_seconds_sum") + total("triptych_queue_wait_seconds_sum")) / max(n, 1)
    return {
        "transfer_s": transfer,
        "stages_s": stages,
        "rest_s": client_mean - stages,
        "transfer_share": transfer / client_mean if client_mean else None,
        "head_share": (client_mean - stages) / client_mean if client_mean else None,
    }


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank); NaN when nothing arrived in the window (a short run at a low rate)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def singles(system, n: int, size: int, steps: int, seed0: int) -> list[float]:
    return [await system.request(body(seed0 + k, size, steps)) for k in range(n)]


async def open_loop(system, rate: float, duration: float, size: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    t0, tasks, lat, k = time.perf_counter(), [], [], 0
    while (now := time.perf_counter() - t0) < duration:
        await asyncio.sleep(min(rng.expovariate(rate), max(0.0, duration - now)))
        if time.perf_counter() - t0 >= duration:
            break

        async def one(i=seed * 10000 + k):
            lat.append(await system.request(body(i, size, steps)))

        tasks.append(asyncio.create_task(one()))
        k += 1
    await asyncio.gather(*tasks)
    span = time.perf_counter() - t0
    return {
        "rate": rate,
        "n": len(lat),
        "throughput": len(lat) / span,
        "p50": pct(lat, 0.5),
        "p95": pct(lat, 0.95),
        "p99": pct(lat, 0.99),
        "mean": statistics.fmean(lat),
    }


async def measure(systems, args) -> list[dict]:
    rows = []
    for rep in range(args.repeats):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for s in order:
            await singles(s, 2, 64, args.steps, 900)  # warm-up
            for size in args.sizes:
                m0 = s.metrics() if s.name in TRIPTYCH else None
                c0 = s.cpu()
                lat = await singles(s, args.singles, size, args.steps, 1000 + rep)
                row = {
                    "cpu_per_request": (s.cpu() - c0) / len(lat),
                    "system": s.name,
                    "repeat": rep,
                    "kind": "single",
                    "size": size,
                    "median": statistics.median(lat),
                }
                if m0 is not None:
                    row.update(split(m0, s.metrics(), len(lat), statistics.fmean(lat)))
                rows.append(row)
                print(json.dumps(row), flush=True)
            for rate in args.rates:
                m0 = s.metrics() if s.name in TRIPTYCH else None
                r = await open_loop(s, rate, args.duration, 64, args.steps, seed=rep * 100 + int(rate * 10))
                row = {"system": s.name, "repeat": rep, "kind": "rate", **r}
                if m0 is not None:
                    row.update(split(m0, s.metrics(), r["n"], r["mean"]))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def tables(rows: list[dict], args) -> str:
    names = list(dict.fromkeys(r["system"] for r in rows))
    out = [
        f"single requests, one at a time: wall median of {args.singles} and CPU seconds per request (all processes",
        "of the system), best repeat of each; ratios t111 / inproc:",
        "",
    ]
    head = " | ".join(f"{n} wall s" for n in names) + " | " + " | ".join(f"{n} CPU s" for n in names)
    out += [f"| size | {head} | wall t111/inproc | CPU t111/inproc | t111 transfer share | t111 head+HTTP share |"]
    out += ["|---" * (2 * len(names) + 5) + "|"]
    for size in args.sizes:
        best = {
            n: min(r["median"] for r in rows if r["system"] == n and r["kind"] == "single" and r["size"] == size)
            for n in names
        }
        t = min(
            (r for r in rows if r["system"] == "t111" and r["kind"] == "single" and r["size"] == size),
            key=lambda r: r["median"],
        )
        cpu = {
            n: min(
                r["cpu_per_request"] for r in rows if r["system"] == n and r["kind"] == "single" and r["size"] == size
            )
            for n in names
        }
        ratio, cratio = best["t111"] / best["inproc"], cpu["t111"] / cpu["inproc"]
        cells = " | ".join(f"{best[n]:.3f}" for n in names) + " | " + " | ".join(f"{cpu[n]:.3f}" for n in names)
        share = f"{t['transfer_share']:.1%} | {t['head_share']:.1%}"
        out.append(f"| {size}² | {cells} | {ratio:.2f}× | {cratio:.2f}× | {share} |")
    out += ["", "open-loop Poisson arrivals, 64², per rate and system (best throughput of the repeats):", ""]
    out += [
        "| rate req/s | system | done | throughput req/s | p50 s | p95 s | p99 s | transfer share | head+HTTP share |"
    ]
    out += ["|---|---|---|---|---|---|---|---|---|"]
    for rate in args.rates:
        for n in names:
            rs = [r for r in rows if r["system"] == n and r["kind"] == "rate" and r["rate"] == rate]
            r = max(rs, key=lambda r: r["throughput"])
            ts = f"{r['transfer_share']:.1%}" if "transfer_share" in r else "-"
            hs = f"{r['head_share']:.1%}" if "head_share" in r else "-"
            out.append(
                f"| {rate:g} | {n} | {r['n']} | {r['throughput']:.2f} | {r['p50']:.3f} | {r['p95']:.3f} | {r['p99']:.3f} | {ts} | {hs} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: tiny seeded FLUX)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--singles", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=["inproc", "naive", "t111", "t121"])
    ap.add_argument("--out", default="benchmarks/serving.json")
    ap.add_argument(
        "--call-kwargs",
        default="{}",
        help="JSON of extra pipeline call arguments for inproc and naive, so they run the math the served model "
        'runs (the default model\'s CFG: \'{"negative_prompt": " ", "true_cfg_scale": 4.0}\')',
    )
    ap.add_argument("--naive-server", help=argparse.SUPPRESS)  # internal: run the naive server on --port
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive_server:
        import uvicorn

        uvicorn.run(
            naive_app(args.naive_server, json.loads(args.call_kwargs)),
            host="127.0.0.1",
            port=args.port,
            log_level="warning",
        )
        return
    from triptych.families.registry import make_tiny

    tmp = tempfile.mkdtemp(prefix="serving-")
    model = args.model or str(make_tiny("flux", Path(tmp) / "flux", seed=0))
    py = [sys.executable]
    servers, systems = [], []
    serve = [*py, "-m", "triptych.cli", "serve", "--model", model, "--threads", "1", "--transfer", "zmq"]
    serve += [
        "--data-dir",
        str(Path(tmp) / "head"),
        "--orchestrator-max-queued",
        "4096",
        "--max-queued-requests",
        "4096",
    ]
    specs = {
        "naive": [*py, __file__, "--naive-server", model, "--call-kwargs", args.call_kwargs],
        "t111": serve,
        "t121": [*serve, "--denoisers", "2"],
        "r121": [*serve, "--denoisers", "2", "--cluster", "ray", *(f"--{r}-cpus=0.5" for r in ROLES)],
    }
    for name in args.systems:
        if name in specs:
            servers.append(Server(name, specs[name], tmp))
    try:
        for s in servers:
            s.wait()
        for name in args.systems:
            systems.append(
                InProc(model, json.loads(args.call_kwargs))
                if name == "inproc"
                else Http(next(s for s in servers if s.name == name))
            )
        rows = asyncio.run(measure(systems, args))
    finally:
        for s in servers:
            s.stop()
    command = "python benchmarks/serving.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(tables(rows, args))


if __name__ == "__main__":
    main()
