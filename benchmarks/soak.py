"""Soak: thousands of mixed requests against real servers on loopback, memory and pools sampled over time.

Three servers, each `triptych serve` in its own process group on 127.0.0.1:
- the default model, 1:2:1 (images, chats about images, cancels by client disconnect),
- the default edit model, 1:1:1 (edits),
- a tiny Wan text-to-video model, 1:1:1 (video jobs, some deleted while they run).
A bounded number of requests (``--requests``, split 70/10/10/10 images/chats/edits/videos) is sent
with ``--concurrency`` in flight; about 10% of image requests are abandoned mid-flight (the client
disconnects, the head cancels). Every ``--sample-every`` seconds the script records, per server,
the summed RSS of its process group, the encoders' mm-hash cache bytes and the free transfer slots
of every worker (``/health``). It ends every process group it started, by pgid.

Pass: after warm-up (the first 20% of the run) the RSS grows by less than 5%, and at the end every
server's pools are full (no slot held, nothing in flight). Writes a PNG plot and a JSON of the samples.

    python benchmarks/soak.py --requests 5000 --concurrency 8 --out benchmarks/reliability
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, model: str, denoisers: int, data: Path):
        self.name, self.port = name, free_port()
        cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", model, "--port", str(self.port)]
        cmd += ["--host", "127.0.0.1", "--denoisers", str(denoisers), "--data-dir", str(data / name)]
        log = open(data / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start")

    def pids(self) -> list[int]:
        """The server's process group (``start_new_session``): the head and every worker it spawned."""
        out = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == self.proc.pid:
                    out.append(proc.pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return out

    def rss_mb(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / (1 << 20)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pools(health: dict) -> tuple[int, int, int]:
    """(free transfer slots, all transfer slots, mm-cache bytes) over a server's workers."""
    free = total = cache = 0
    for inst in health["backend"]["instances"]:
        r = inst.get("report") or {}
        free += r.get("free_slots", 0)
        total += r.get("max_slots", 0)
    for line in httpx.get(health["_url"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith("triptych_mm_cache_bytes{"):
            cache += int(float(line.rsplit(" ", 1)[1]))
    return free, total, cache


def png(color=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(buf, format="PNG")
    return buf.getvalue()


async def one(client: httpx.AsyncClient, servers: dict, kind: str, i: int, counts: dict) -> None:
    rng = random.Random(f"soak-{i}")  # not the stream that chose the kind (that one would decide this too)
    try:
        if kind == "image":
            body = {"prompt": f"a red circle on a blue background {i}", "size": "64x64", "num_inference_steps": 2}
            body["seed"] = i
            call = client.post(f"{servers['image'].url}/v1/images/generations", json=body, timeout=300)
            if rng.random() < 0.1:  # the client goes away mid-flight: the head must cancel and free everything
                task = asyncio.ensure_future(call)
                await asyncio.sleep(rng.uniform(0.01, 0.3))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                counts["disconnected"] += 1
                return
            r = await call
        elif kind == "chat":
            url = "data:image/png;base64," + base64.b64encode(png()).decode()
            content = [
                {"type": "text", "text": "What is in this image?"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
            body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
            r = await client.post(f"{servers['image'].url}/v1/chat/completions", json=body, timeout=300)
        elif kind == "edit":
            files = {"image": ("a.png", png((rng.randrange(256), 40, 40)), "image/png")}
            data = {"prompt": "make the circle green", "size": "64x64", "num_inference_steps": "2", "seed": str(i)}
            r = await client.post(f"{servers['edit'].url}/v1/images/edits", files=files, data=data, timeout=300)
        else:
            body = {"prompt": f"a ball {i}", "size": "32x32", "frames": 5, "num_inference_steps": 2, "seed": i}
            r = await client.post(f"{servers['video'].url}/v1/videos", json=body, timeout=60)
            if r.status_code == 200 and rng.random() < 0.2:
                await client.delete(f"{servers['video'].url}/v1/videos/{r.json()['id']}", timeout=60)
                counts["video_deleted"] += 1
        counts[f"{kind}_{r.status_code}"] += 1
    except httpx.HTTPError as e:
        counts[f"{kind}_{type(e).__name__}"] += 1


async def drive(servers: dict, n: int, concurrency: int, sample, counts: dict) -> None:
    kinds = ["image"] * 7 + ["chat", "edit", "video"]
    queue = [(random.Random(i).choice(kinds), i) for i in range(n)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:

        async def run(kind, i):
            async with sem:
                await one(client, servers, kind, i, counts)
                counts["done"] += 1

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(run(k, i) for k, i in queue))
        sampler.cancel()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--out", default="benchmarks/reliability")
    args = ap.parse_args()
    from collections import Counter

    from triptych.families.models import PACKAGED_DEFAULT
    from triptych.families.registry import make_tiny

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="triptych-soak-"))
    wan = make_tiny("wan-t2v", data / "wan")
    servers = {
        "image": Server("image", str(PACKAGED_DEFAULT), 2, data),
        "edit": Server("edit", str(PACKAGED_DEFAULT.parent / "default_edit"), 1, data),
        "video": Server("video", str(wan), 1, data),
    }
    samples: list[dict] = []
    counts: Counter = Counter()
    t0 = time.monotonic()
    try:
        for s in servers.values():
            s.wait_ready()

        async def sample():
            while True:
                row = {"t": time.monotonic() - t0, "done": counts["done"]}
                for name, s in servers.items():
                    health = httpx.get(f"{s.url}/health", timeout=10).json()
                    health["_url"] = s.url
                    free, total, cache = pools(health)
                    row[name] = {"rss_mb": s.rss_mb(), "free": free, "slots": total, "cache": cache}
                samples.append(row)
                await asyncio.sleep(args.sample_every)

        asyncio.run(drive(servers, args.requests, args.concurrency, sample, counts))
        time.sleep(3 * args.sample_every)  # let heartbeats report the pools after the last request
        end = {}
        for name, s in servers.items():
            health = httpx.get(f"{s.url}/health", timeout=10).json()
            health["_url"] = s.url
            free, total, cache = pools(health)
            held = [i["id"] for i in health["backend"]["instances"] if i["held"]]
            end[name] = {
                "rss_mb": s.rss_mb(),
                "free": free,
                "slots": total,
                "held": held,
                "in_flight": health["in_flight"],
            }
    finally:
        for s in servers.values():
            s.stop()
    warm = [r for r in samples if r["done"] >= 0.2 * args.requests]
    verdict = {}
    for name in servers:
        first, last = warm[0][name]["rss_mb"], end[name]["rss_mb"]
        growth = (last - first) / first
        full = end[name]["free"] == end[name]["slots"] and not end[name]["held"] and end[name]["in_flight"] == 0
        verdict[name] = {"rss_after_warmup_mb": first, "rss_end_mb": last, "growth": growth, "pools_full": full}
    result = {"counts": dict(counts), "seconds": time.monotonic() - t0, "verdict": verdict, "end": end}
    (out / "soak.json").write_text(json.dumps({**result, "samples": samples}, indent=1))
    plot(samples, out / "soak.png")
    print(json.dumps(result, indent=1))
    ok = all(v["growth"] < 0.05 and v["pools_full"] for v in verdict.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = [r["t"] for r in samples]
    for name in ("image", "edit", "video"):
        axes[0].plot(t, [r[name]["rss_mb"] for r in samples], label=name)
        axes[1].plot(t, [r[name]["cache"] / 2**20 for r in samples], label=name)
        axes[2].plot(t, [r[name]["free"] for r in samples], label=name)
    axes[0].set_ylabel("RSS of the server (MB)")
    axes[1].set_ylabel("mm-hash cache (MB)")
    axes[2].set_ylabel("free transfer slots")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    raise SystemExit(main())
