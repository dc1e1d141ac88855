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

4. A vision flood (``--flood``, instead of 1-3): servers side by side, one admitting by item
   counts (``--step-time-budget 0``, the old default), one by time with one image a tower forward
   beside decoding chats (``--vision-call-stretch 0``, the default) and one by time with the
   waiting images batched into the forward (``--vision-call-stretch 1``); ``--flood-servers`` picks; chats with 8
   new images each (max_tokens 4) arrive open-loop at ``--flood-rates`` chats per second for
   ``--flood-window-s`` beside a streamed chat (max_tokens 64, a new one when it ends), the
   servers alternating within each repeat. Per rate and server: the stream's p99 gap between
   pieces against the stream alone on that server, and the flood's chats answered per second
   (first arrival to last answer) against the same flood without the stream.

    python benchmarks/chat_served.py [--repeats 5] [--prefill-tokens-per-step 64]
    python benchmarks/chat_served.py --flood [--repeats 3] [--flood-rates 2 4 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import math
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


def fresh_urls(n: int, counter: list[int]) -> list[str]:
    """``n`` images never sent before in this run (a counter in each one's corner pixel)."""
    urls = []
    for scene in sample_scenes(n, f"flood-{counter[0]}", "heldout"):
        image = render(scene, 64)
        image.putpixel((0, 0), (counter[0] % 256, (counter[0] // 256) % 256, 7))
        counter[0] += 1
        urls.append(data_url(image))
    return urls


async def flood_run(client, stream_body: dict | None, flood: list[dict], rate: float, window_s: float):
    """(the stream's gaps within the window, flood chats answered, first arrival to last answer)."""
    start = time.perf_counter()

    async def one(i: int, b: dict) -> float:
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        out = await ask(client, b)
        assert out["usage"]["completion_tokens"] == 4
        return time.perf_counter()

    tasks = [asyncio.create_task(one(i, b)) for i, b in enumerate(flood)]
    gaps: list[float] = []
    while stream_body is not None and time.perf_counter() - start < window_s:
        gaps += await stream_gaps(client, stream_body)
    done = await asyncio.gather(*tasks)
    return gaps, len(done), max(done, default=start) - start


async def flood_bench(servers: dict[str, Server], args) -> None:
    clients = {name: httpx.AsyncClient(base_url=s.base, timeout=600) for name, s in servers.items()}
    try:
        first = next(iter(clients.values()))
        model = next(m["id"] for m in (await first.get("/v1/models")).json()["data"] if m.get("chat"))
        image = data_url(render(sample_scenes(1, "chat-served-flood", "heldout")[0], 64))
        stream_body = body(model, [image], 64, stream=True, question="Describe it")
        counter = [0]

        def flood(n: int) -> list[dict]:
            return [body(model, fresh_urls(8, counter), 4, question="Compare them") for _ in range(n)]

        for client in clients.values():  # warm-up
            await flood_run(client, stream_body, flood(2), 4.0, 0.5)
        idle: dict[str, list[float]] = {name: [] for name in clients}
        runs: dict[tuple[float, str, bool], list[tuple]] = {}
        loads = []
        for _ in range(args.repeats):
            for name, client in clients.items():
                idle[name] += (await flood_run(client, stream_body, [], 1.0, args.flood_window_s))[0]
            for rate in args.flood_rates:
                for name, client in clients.items():
                    for with_stream in (False, True):
                        bodies = flood(math.ceil(rate * args.flood_window_s))
                        got = await flood_run(
                            client, stream_body if with_stream else None, bodies, rate, args.flood_window_s
                        )
                        runs.setdefault((rate, name, with_stream), []).append(got)
            loads.append(os.getloadavg()[0])
    finally:
        for client in clients.values():
            await client.aclose()
    print(
        f"vision flood over HTTP: 8 new images a chat, window {args.flood_window_s} s, {args.repeats} repeats, "
        f"load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print("idle stream p99 gap: " + ", ".join(f"{n} {p99(g) * 1e3:.1f} ms ({len(g)} gaps)" for n, g in idle.items()))
    print(
        "\n| flood chats/s | admission | stream p99 gap ms | vs idle | stream p50 gap ms | max gap ms | "
        "flood answered/s alone | with the stream | vs alone |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in args.flood_rates:
        for name in clients:
            gaps = [g for r in runs[(rate, name, True)] for g in r[0]]

            def per_s(with_stream: bool) -> float:
                rs = runs[(rate, name, with_stream)]
                return sum(r[1] for r in rs) / sum(r[2] for r in rs)

            alone, beside = per_s(False), per_s(True)
            print(
                f"| {rate:g} | {name} | {p99(gaps) * 1e3:.1f} | {p99(gaps) / p99(idle[name]):.2f}x | "
                f"{statistics.median(gaps) * 1e3:.1f} | {max(gaps) * 1e3:.1f} | {alone:.2f} | {beside:.2f} | "
                f"{beside / alone:.2f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--burst-every-s", type=float, default=0.25)
    ap.add_argument("--prefill-tokens-per-step", type=int, default=None, help="passed to serve (default: its own)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--flood", action="store_true", help="part 4 only: items vs time admission, two servers")
    ap.add_argument("--flood-rates", type=float, nargs="+", default=[2.0, 4.0, 8.0], help="chats per second")
    ap.add_argument("--flood-window-s", type=float, default=2.0)
    ap.add_argument(
        "--flood-servers",
        nargs="+",
        default=["items (old)", "time, call per image", "time, batched calls"],
        help="which admissions to serve side by side",
    )
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="chat-served-")

    def command(name: str, *extra: str) -> list[str]:
        cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", str(PACKAGED_DEFAULT), "--threads"]
        cmd += [str(args.threads), "--transfer", "zmq", "--data-dir", str(Path(tmp) / name), *extra]
        if args.prefill_tokens_per_step is not None:
            cmd += ["--prefill-tokens-per-step", str(args.prefill_tokens_per_step)]
        return cmd

    if args.flood:
        flags = {
            "items (old)": ("items", "--step-time-budget", "0"),
            "time, call per image": ("per-image", "--vision-call-stretch", "0"),
            "time, batched calls": ("batched", "--vision-call-stretch", "1"),
        }
        servers = {name: Server(f[0], command(*f), tmp) for name, f in flags.items() if name in args.flood_servers}
        try:
            for server in servers.values():
                server.wait()
            asyncio.run(flood_bench(servers, args))
        finally:
            for server in servers.values():
                server.stop()
        return
    server = Server("serve", command("head"), tmp)
    try:
        server.wait()
        asyncio.run(bench(server, args))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
