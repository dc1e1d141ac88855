"""Chats over HTTP through a real ``triptych serve`` on the default model (one encoder, its chat
engine; the head routes chats against the encoder's chat slots).

1. Tokens/s at 1, 4 and 8 concurrent chats (``POST /v1/chat/completions``, max_tokens 32,
   ignore_eos, greedy, one distinct image each), the concurrencies alternating within each repeat,
   after a warm-up round. Wall-clock tokens/s (all completion tokens over the round's wall time;
   the median round) and tokens per CPU-second of the server's process tree (head and workers;
   all rounds of a concurrency summed, psutil counts 10 ms ticks), with the load
   average beside them. Each answer is checked token-identical to its answer alone (asked first,
   one at a time), and the engine's largest decode batch is read from ``/metrics``.
2. Streaming: the time between streamed pieces of 4 streaming chats (max_tokens 64, ignore_eos),
   idle vs while chats with 8 images each arrive (one every ``--burst-every-s``); p99 of each, over
   all repeats.
3. Where the time to first token went, over all the chats of 1 and 2: the head's chat latency
   histograms (``triptych_chat_*_seconds``) read before and after, their mean, p50 and p99 (p50
   and p99 interpolated within the buckets, as Prometheus' ``histogram_quantile``).

    python benchmarks/chat_served.py [--repeats 5] [--prefill-tokens-per-step 64]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serving import Server  # noqa: E402

from shapeworld import render, sample_scenes  # noqa: E402
from triptych.families.models import PACKAGED_DEFAULT  # noqa: E402

QUESTION = "What is in this image?"


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(model: str, urls: list[str], max_tokens: int, stream: bool = False, question: str = QUESTION) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": question}]
    return {
        "model": model,
        "messages": [{"role": "system", "content": "You describe images."}, {"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def tree_cpu(pid: int) -> float:
    """CPU seconds of the server (the head) and every process under it (its workers)."""
    return sum(process_cpu(pid).values())


def process_cpu(pid: int) -> dict[int, float]:
    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


async def ask(client: httpx.AsyncClient, b: dict) -> dict:
    r = await client.post("/v1/chat/completions", json=b)
    r.raise_for_status()
    return r.json()


async def round_of(client, server, bodies: list[dict]) -> tuple[float, float, list[dict]]:
    cpu, t = tree_cpu(server.proc.pid), time.perf_counter()
    out = await asyncio.gather(*(ask(client, b) for b in bodies))
    return time.perf_counter() - t, tree_cpu(server.proc.pid) - cpu, out


async def stream_gaps(client, b: dict) -> list[float]:
    gaps, last = [], None
    async with client.stream("POST", "/v1/chat/completions", json=b) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]" or '"content"' not in line:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def streaming(client, model, urls, burst: bool, every_s: float) -> list[float]:
    streams = [asyncio.create_task(stream_gaps(client, body(model, [urls[i]], 64, stream=True))) for i in range(4)]
    bursts = []
    while burst and not all(s.done() for s in streams):
        bursts.append(asyncio.create_task(ask(client, body(model, urls[:8], 4, question="Compare them"))))
        await asyncio.sleep(every_s)
    gaps = [g for s in await asyncio.gather(*streams) for g in s]
    await asyncio.gather(*bursts)
    return gaps


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def max_batch(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    values = [float(v) for v in re.findall(r"^triptych_chat_max_batch\{[^}]*\} (\S+)$", text, re.M)]
    return max(values, default=float("nan"))


CHAT_LATENCY = ("media_decode", "queue", "vision_encode", "prefill", "time_to_first_token", "inter_token")


def histograms(text: str, model: str) -> dict[str, tuple[list[tuple[float, float]], float, float]]:
    """``triptych_chat_<stage>_seconds`` of ``model`` in a ``/metrics`` text: stage → (cumulative
    buckets as (le, count), sum, count)."""
    out = {}
    for family in text_string_to_metric_families(text):
        stage = family.name.removeprefix("triptych_chat_").removesuffix("_seconds")
        if stage not in CHAT_LATENCY:
            continue
        buckets, total, count = [], 0.0, 0.0
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
        out[stage] = (sorted(buckets), total, count)
    return out


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The ``q`` quantile of cumulative ``buckets``, linear within the bucket it falls in (the +Inf
    bucket: its lower bound), as Prometheus' ``histogram_quantile``."""
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / (cum - below) if cum > below else le
        lower, below = le, cum
    return lower


def latency_split(before: str, after: str, model: str) -> list[tuple[str, int, float, float, float]]:
    """(stage, observations, mean s, p50 s, p99 s) of what ``model``'s chats added from ``before`` to
    ``after`` (two ``/metrics`` texts)."""
    was, now = histograms(before, model), histograms(after, model)
    rows = []
    for stage in CHAT_LATENCY:
        buckets, total, count = now.get(stage, ([], 0.0, 0.0))
        old_buckets, old_total, old_count = was.get(stage, ([], 0.0, 0.0))
        old = dict(old_buckets)
        delta = [(le, cum - old.get(le, 0.0)) for le, cum in buckets]
        n = count - old_count
        mean = (total - old_total) / n if n else float("nan")
        rows.append((stage, int(n), mean, bucket_quantile(0.5, delta), bucket_quantile(0.99, delta)))
    return rows


def print_latency_split(rows) -> None:
    print("\n| chat stage (head's /metrics) | observations | mean ms | p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for stage, n, mean, p50, p99_ in rows:
        print(f"| {stage} | {n} | {mean * 1e3:.1f} | {p50 * 1e3:.1f} | {p99_ * 1e3:.1f} |")


async def bench(server: Server, args) -> None:
    async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = next(m["id"] for m in models if m.get("chat"))
        images = [render(s, 64) for s in sample_scenes(8, "chat-served-bench", "heldout")]
        urls = [data_url(im) for im in images]
        bodies = [body(model, [u], 32) for u in urls]
        alone = [(await ask(client, b))["choices"][0]["message"]["content"] for b in bodies]
        for n in (1, 4, 8):  # warm-up
            await round_of(client, server, bodies[:n])
        metrics_before = (await client.get("/metrics")).text
        before = process_cpu(server.proc.pid)
        wall: dict[int, list[float]] = {}
        cpu: dict[int, list[float]] = {}  # (tokens, CPU s) per round: summed (psutil ticks are 10 ms)
        mismatches = total = 0
        for _ in range(args.repeats):
            for n in (1, 4, 8):
                seconds, cpu_s, out = await round_of(client, server, bodies[:n])
                tokens = sum(o["usage"]["completion_tokens"] for o in out)
                wall.setdefault(n, []).append(tokens / seconds)
                cpu.setdefault(n, []).append((tokens, cpu_s))
                mismatches += sum(o["choices"][0]["message"]["content"] != a for o, a in zip(out, alone))
                total += n
        after = process_cpu(server.proc.pid)
        spent = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
        head = spent.pop(server.proc.pid, 0.0)
        load = os.getloadavg()
        print(f"CPU seconds of the tokens/s rounds: head {head:.1f}, workers {sum(spent.values()):.1f}")
        print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs\n")
        print("| concurrent chats | tokens/s (wall) | vs 1 chat | tokens per CPU-s (server tree) | vs 1 chat |")
        print("|---|---|---|---|---|")

        def per_cpu_s(n: int) -> float:
            return sum(t for t, _ in cpu[n]) / sum(c for _, c in cpu[n])

        w1, c1 = statistics.median(wall[1]), per_cpu_s(1)
        for n in (1, 4, 8):
            w, c = statistics.median(wall[n]), per_cpu_s(n)
            print(f"| {n} | {w:.0f} | {w / w1:.2f}x | {c:.0f} | {c / c1:.2f}x |")
        print(f"\nanswers differing from their answer alone: {mismatches} of {total}")
        print(f"largest chat decode batch seen by the engine: {max_batch(server.base):.0f}\n")

        idle, busy = [], []
        for _ in range(args.repeats):
            idle += await streaming(client, model, urls, False, args.burst_every_s)
            busy += await streaming(client, model, urls, True, args.burst_every_s)
        load = os.getloadavg()
        print(
            f"streaming p99 time between pieces: idle {p99(idle) * 1e3:.1f} ms, with 8-image chats arriving "
            f"every {args.burst_every_s}s {p99(busy) * 1e3:.1f} ms ({p99(busy) / p99(idle):.2f}x); "
            f"load average {load[0]:.2f}"
        )
        print_latency_split(latency_split(metrics_before, (await client.get("/metrics")).text, model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--burst-every-s", type=float, default=0.25)
    ap.add_argument("--prefill-tokens-per-step", type=int, default=None, help="passed to serve (default: its own)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="chat-served-")
    cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", str(PACKAGED_DEFAULT), "--threads"]
    cmd += [str(args.threads), "--transfer", "zmq", "--data-dir", str(Path(tmp) / "head")]
    if args.prefill_tokens_per_step is not None:
        cmd += ["--prefill-tokens-per-step", str(args.prefill_tokens_per_step)]
    server = Server("serve", cmd, tmp)
    try:
        server.wait()
        asyncio.run(bench(server, args))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
