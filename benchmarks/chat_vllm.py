"""Chat tokens/s at 1, 4 and 8 concurrent chats: the built-in engine, Triptych with the vLLM engine,
and the same vLLM server asked directly (pixels in, its own vision tower), in one run.

Two ``triptych serve`` processes run side by side on the packaged default model (one encoder, no
denoiser or decoder): ``--chat-engine builtin`` and ``--chat-engine vllm``; the second's vLLM server
is also the plain one, asked on its own port. Each measurement is ``concurrency`` clients, each
sending ``--chats`` chats one after another (one image each, max_tokens 32, ignore_eos, greedy);
tokens/s = completion tokens / wall time. Targets alternate within every repeat (order rotated),
after one warm-up measurement each; the median of the repeats is reported, with Triptych-vLLM /
plain-vLLM (the cost of Triptych in front of vLLM) and vLLM / built-in.

    .venv/bin/python benchmarks/chat_vllm.py --repeats 3 --out benchmarks/chat_vllm.json

``--split-cores`` puts vLLM's processes on core 0 and everything else on core 1 (``split_cores``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shapeworld import render, sample_scenes  # noqa: E402
from triptych.families.models import PACKAGED_DEFAULT  # noqa: E402

MAX_TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(
    engine: str, port: int, data: Path, vllm_port: int, vllm_python: Path, threads: int
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", f"default={PACKAGED_DEFAULT}"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)]
    cmd += ["--encoders", "1", "--denoisers", "0", "--decoders", "0", "--capacity", "16", "--transfer", "zmq"]
    cmd += ["--chat-engine", engine]
    if engine == "vllm":
        # one torch thread for the encoder: it only preprocesses and hits its mm-hash cache, and a
        # second OpenMP thread spinning between ops takes CPU from vLLM's pinned core
        cmd += ["--vllm-python", str(vllm_python), "--vllm-port", str(vllm_port), "--threads", str(threads)]
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "serve.log", "wb") as log:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_encoder(proc: subprocess.Popen, base: str, log: Path, deadline_s: float = 1200) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if "encoder" not in httpx.get(f"{base}/health", timeout=2).json().get("missing_roles", ["encoder"]):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{base} not up within {deadline_s}s")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def role(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    for key, name in (("--role encoder", "encoder"), ("api_server", "vLLM API server"), ("serve", "head")):
        if key in cmd:
            return name
    return proc.name().removeprefix("VLLM::")  # EngineCore, Worker (the resource tracker: python)


def cpu_seconds(serve: subprocess.Popen) -> dict[str, float]:
    """CPU seconds (user + system) so far of the vLLM serve's processes, by role."""
    out: dict[str, float] = {}
    root = psutil.Process(serve.pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            out[role(proc)] = out.get(role(proc), 0.0) + sum(proc.cpu_times()[:2])
        except psutil.Error:
            pass
    return out


def split_cores(serves: dict[str, subprocess.Popen]) -> None:
    """vLLM's processes (its API server and all below it) on core 0; the serves' head and encoder
    processes, and this client, on core 1: Triptych's hops no longer queue behind vLLM's polling
    EngineCore and Worker, as in a deployment where the encoders and the head run beside the vLLM
    server rather than on its cores."""
    for proc in serves.values():
        root = psutil.Process(proc.pid)
        for child in [root, *root.children(recursive=True)]:
            inside_vllm = "api_server" in " ".join(child.cmdline()) or any(
                "api_server" in " ".join(p.cmdline()) for p in child.parents()
            )
            pin(child, 0 if inside_vllm else 1)
    pin(psutil.Process(), 1)


def pin(proc: psutil.Process, core: int) -> None:
    """Every thread of ``proc`` (``sched_setaffinity`` on a pid moves only its main thread)."""
    for thread in proc.threads():
        os.sched_setaffinity(thread.id, {core})


def vllm_seconds(vllm_url: str) -> tuple[float, float]:
    """vLLM's own time on its requests so far: the sum and count of its e2e request latency."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(f"vllm:e2e_request_latency_seconds{suffix}"):
                out[suffix] = out.get(suffix, 0.0) + float(line.rsplit(" ", 1)[1])
    return out.get("_sum", 0.0), out.get("_count", 0.0)


async def measure(url: str, concurrency: int, chats: int, image_url: str) -> tuple[float, float]:
    """Tokens/s and the mean seconds per chat as its client saw it."""
    body = {
        "model": "default",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    tokens, latencies = 0, []

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for _ in range(chats):
            t = time.perf_counter()
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
            resp.raise_for_status()
            latencies.append(time.perf_counter() - t)
            tokens += resp.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=300) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    assert tokens == concurrency * chats * MAX_TOKENS, tokens
    return tokens / wall, statistics.mean(latencies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chats", type=int, default=3, help="chats per client per measurement")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--data", type=Path, default=ROOT / "out" / "chat_vllm")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--vllm-threads", type=int, default=1, help="torch threads of the vLLM-engine serve's encoder")
    p.add_argument(
        "--split-cores", action="store_true", help="vLLM's processes on core 0, the serves' and this client on core 1"
    )
    args = p.parse_args()
    ports = {"builtin": free_port(), "vllm": free_port()}
    vllm_port = free_port()
    procs = {e: start_serve(e, ports[e], args.data / e, vllm_port, args.vllm_python, args.vllm_threads) for e in ports}
    targets = {
        "builtin": f"http://127.0.0.1:{ports['builtin']}",
        "triptych+vllm": f"http://127.0.0.1:{ports['vllm']}",
        "plain vllm": f"http://127.0.0.1:{vllm_port}",
    }
    image = data_url(render(sample_scenes(1, "bench-chat-vllm", "heldout")[0], 64))
    try:
        for e, proc in procs.items():
            wait_encoder(proc, targets["builtin" if e == "builtin" else "triptych+vllm"], args.data / e / "serve.log")
        if args.split_cores:
            split_cores(procs)
        results: dict[str, dict[int, list[float]]] = {t: {c: [] for c in args.concurrency} for t in targets}
        split: dict[str, dict[int, list]] = {t: {c: [] for c in args.concurrency} for t in targets}
        cpu: dict[str, dict[int, list]] = {t: {c: [] for c in args.concurrency} for t in targets}
        names = list(targets)
        for c in args.concurrency:
            for t in names:  # warm-up: caches, vLLM's first batches of this size
                asyncio.run(measure(targets[t], c, 1, image))
            for r in range(args.repeats):
                for t in names[r % 3 :] + names[: r % 3]:
                    before, cpu0 = vllm_seconds(targets["plain vllm"]), cpu_seconds(procs["vllm"])
                    tps, latency = asyncio.run(measure(targets[t], c, args.chats, image))
                    (s0, n0), (s1, n1) = before, vllm_seconds(targets["plain vllm"])
                    cpu[t][c].append(
                        {k: (v - cpu0.get(k, 0.0)) / (c * args.chats) for k, v in cpu_seconds(procs["vllm"]).items()}
                    )
                    inside = (s1 - s0) / (n1 - n0) if n1 > n0 else 0.0
                    results[t][c].append(tps)
                    if t != "builtin":
                        split[t][c].append((latency, inside))
                    print(
                        f"c={c} repeat {r} {t}: {tps:.0f} tokens/s, {latency * 1e3:.0f} ms per chat"
                        + (f" ({inside * 1e3:.0f} inside vLLM's engine)" if t != "builtin" else "")
                        + f" (load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
    finally:
        for proc in procs.values():
            stop(proc)
    table = {t: {c: statistics.median(v) for c, v in per.items()} for t, per in results.items()}
    print(f"\nload average {os.getloadavg()[0]:.1f}; tokens/s (median of {args.repeats})")
    print("concurrency | built-in | Triptych+vLLM | plain vLLM | Triptych+vLLM / plain | vLLM / built-in")
    for c in args.concurrency:
        b, tv, v = table["builtin"][c], table["triptych+vllm"][c], table["plain vllm"][c]
        print(f"{c} | {b:.0f} | {tv:.0f} | {v:.0f} | {tv / v:.2f} | {tv / b:.2f}")
    print("concurrency | ms per chat: Triptych+vLLM (of it in vLLM's engine) | plain vLLM (in its engine)")
    for c in args.concurrency:
        (tl, ti), (vl, vi) = ((statistics.median(x) * 1e3 for x in zip(*split[t][c])) for t in names[1:])
        print(f"{c} | {tl:.0f} ({ti:.0f}) | {vl:.0f} ({vi:.0f})")
    print(
        "CPU ms per chat of the vLLM serve's processes (median; EngineCore and Worker poll, so theirs follows wall time)"
    )
    for c in args.concurrency:
        for t in names[1:]:
            per = {k: statistics.median(d.get(k, 0.0) for d in cpu[t][c]) * 1e3 for k in cpu[t][c][0]}
            print(f"{c} {t}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items()) if k != "python"))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "median": table,
                    "runs": results,
                    "latency_inside": split,
                    "cpu_per_chat": cpu,
                    "load": os.getloadavg(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
