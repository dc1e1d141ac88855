"""Chat decoding on the default model: the batched chat engine vs one chat at a time, and the prefix
KV cache on five questions about one image; same weights, same run, configurations alternating.

1. Tokens/s at 1, 4 and 8 concurrent chats (max_tokens 32, ignore_eos, one distinct image each),
   all submitted at once to one ``ChatEngine``:
   - ``one at a time``: ``max_running_chats=1`` (the old encoder behaviour: the first chat decodes,
     the others wait; one forward per token of one chat),
   - ``batched``: ``max_running_chats=16`` (every running chat advances in one forward per token),
   - ``generate``: ``ChatModel.run`` (transformers' ``generate``) called for each chat in turn, the
     path the engine replaced in the encoder, as the reference for the emulation above.
   Each answer is checked token-identical to its ``generate`` answer alone.
2. Five questions about one image (same system prompt and image, different question; max_tokens 16)
   asked in turn, prefix cache off vs on: prompt tokens each question's prefill computed, and its
   latency (submit to answer).
3. Streaming: p99 time between tokens of 4 streaming chats (max_tokens 64), idle vs while chats
   with 8 images each arrive (one every ``--burst-every-s`` of wall time, 0.25 s).
4. A vision flood (``--only-flood``): chats with 8 new images each (never seen before: the vision
   tower runs for all of them; max_tokens 4) arrive open-loop at ``--flood-rates`` chats per second
   for ``--flood-window-s``, beside one streamed chat (max_tokens 64, a new one when it ends), with
   admission by item counts (``step_time_budget=0``, the old default), by time with one tower
   call per image (the default, ``vision_call_stretch=0``), by time with the waiting images
   batched into the step's tower call (``vision_call_stretch=1``), and by time with
   the tower on the engine's vision thread (``vision_thread``), alternating within each repeat
   (``--flood-modes`` picks some). Per rate and mode: the stream's p99 gap between tokens against
   the stream alone (same mode), and the flood's throughput (its chats answered over first
   arrival to last answer) against the same flood without the stream.

Medians over ``--repeats`` (after a warm-up). Tokens/s in part 1 are per second of process CPU time
(one torch thread), which a loaded shared machine disturbs far less than wall time; latencies and
gaps in parts 2 and 3 are wall time. Prints markdown tables.

    python benchmarks/chat_batching.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

from shapeworld import render, sample_scenes  # noqa: E402
from triptych.chat import ChatParams, ChatTurn  # noqa: E402
from triptych.chat.config import ChatEngineConfig  # noqa: E402
from triptych.chat.engine import ChatEngine  # noqa: E402
from triptych.families.base import Role  # noqa: E402
from triptych.families.models import PACKAGED_DEFAULT  # noqa: E402
from triptych.families.registry import family_class  # noqa: E402

QUESTIONS = ("What is in this image?", "What colour is the shape?", "Where is it?", "Describe the background", "Size?")


def ask(question, images, **kw) -> ChatParams:
    return ChatParams(
        (ChatTurn("system", ("You describe images.",)), ChatTurn("user", (*range(len(images)), question))),
        tuple(images),
        **kw,
    )


def drain(engine: ChatEngine) -> None:
    while engine.has_work():
        engine.step()


def concurrent(chat, prompts, mode: str) -> tuple[float, list]:
    """Process CPU seconds (one torch thread: the work, whatever else the machine runs) and results."""
    t = time.process_time()
    if mode == "generate":
        results = [chat.run(p) for p in prompts]
    else:
        engine = ChatEngine(chat, ChatEngineConfig(max_running_chats=1 if mode == "one" else 16, prefix_cache_mb=0))
        chats = [engine.submit(i, p) for i, p in enumerate(prompts)]
        drain(engine)
        results = [c.result for c in chats]
    return time.process_time() - t, results


def five_questions(chat, image, prefix_mb: float) -> tuple[list[int], list[float]]:
    engine = ChatEngine(chat, ChatEngineConfig(prefix_cache_mb=prefix_mb))
    computed, latency = [], []
    for q in QUESTIONS:
        before = engine.stats.prefill_computed
        t = time.perf_counter()
        engine.submit(q, ask(q, [image], max_tokens=16))
        drain(engine)
        latency.append(time.perf_counter() - t)
        computed.append(engine.stats.prefill_computed - before)
    return computed, latency


def gaps(chat, images, burst: bool, every_s: float = 0.25) -> list[float]:
    """Seconds between consecutive tokens of 4 streaming chats (``burst``: a chat with 8 images
    arrives every ``every_s`` seconds of wall time, the first at the 4th step)."""
    engine = ChatEngine(chat, ChatEngineConfig(prefix_cache_mb=0))
    prompts = [ask("Describe it", [images[i]], max_tokens=64, ignore_eos=True) for i in range(4)]
    streams = [engine.submit(i, p, stream=True) for i, p in enumerate(prompts)]
    seen = [0] * 4
    when: list[float | None] = [None] * 4
    out: list[float] = []
    step, next_burst = 0, None
    while not all(s.done for s in streams):
        if burst and step >= 4 and (next_burst is None or time.perf_counter() >= next_burst):
            engine.submit(f"b{step}", ask("Compare them", images[:8], max_tokens=4))
            next_burst = time.perf_counter() + every_s
        engine.step()
        now = time.perf_counter()
        for i, s in enumerate(streams):
            if len(s.tokens) > seen[i]:
                if when[i] is not None:
                    out.append(now - when[i])
                seen[i], when[i] = len(s.tokens), now
        step += 1
    return out


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


class Fresh:
    """Chats with 8 images never shown before in this process: each image's corner pixel carries a
    counter, so no content hash repeats and every image runs the vision tower."""

    def __init__(self):
        self.n = 0

    def chat(self) -> ChatParams:
        scenes = sample_scenes(8, f"flood-{self.n}", "heldout")
        images = []
        for scene in scenes:
            image = render(scene, 64)
            image.putpixel((0, 0), (self.n % 256, (self.n // 256) % 256, 7))
            images.append(image)
            self.n += 1
        return ask("Compare them", images, max_tokens=4, ignore_eos=True)


@dataclass
class FloodRun:
    gaps: list[float]  # seconds between the stream's consecutive tokens, within the window
    answered: int  # flood chats answered
    seconds: float  # first arrival to last answer


def flood_run(chat, config, image, prompts, rate: float, window_s: float, stream: bool) -> FloodRun:
    """``prompts`` arrive at ``rate`` per second from the window's start (after the stream, if any,
    has decoded 8 tokens); the stream runs through the window (a new one when it ends), then the
    engine drains the flood."""
    engine = ChatEngine(chat, config)
    stream_params = ask("Describe it", [image], max_tokens=64, ignore_eos=True)
    live = engine.submit("s0", stream_params, stream=True) if stream else None
    while live is not None and len(live.tokens) < 8:
        engine.step()
    start = time.perf_counter()
    arrivals = [start + i / rate for i in range(len(prompts))]
    flood, done_at, gaps = [], {}, []
    seen, last, streams = 0 if live is None else len(live.tokens), None, 1
    while True:
        now = time.perf_counter()
        while len(flood) < len(prompts) and arrivals[len(flood)] <= now:
            flood.append(engine.submit(f"f{len(flood)}", prompts[len(flood)]))
        in_window = now - start < window_s
        if live is not None and (live.done or not in_window):
            if not in_window:
                engine.cancel(live.id)
                live = None
            else:
                live, seen, last = engine.submit(f"s{streams}", stream_params, stream=True), 0, None
                streams += 1
        if len(flood) == len(prompts) and len(done_at) == len(flood) and live is None:
            break
        if not engine.has_work():
            time.sleep(max(0.0, min(arrivals[len(flood)] - now, 0.01)) if len(flood) < len(prompts) else 0.001)
            continue
        engine.step()
        now = time.perf_counter()
        if live is not None and len(live.tokens) > seen:
            if last is not None:
                gaps.append(now - last)
            seen, last = len(live.tokens), now
        for c in flood:
            if c.done and c.id not in done_at:
                done_at[c.id] = now
    assert all(c.result is not None and c.result.completion_tokens == 4 for c in flood)
    return FloodRun(gaps, len(flood), max(done_at.values(), default=start) - start)


FLOOD_MODES = {
    "items (old)": ChatEngineConfig(step_time_budget=0, prefix_cache_mb=0),
    "time, call per image": ChatEngineConfig(prefix_cache_mb=0),
    "time, batched calls": ChatEngineConfig(vision_call_stretch=1.0, prefix_cache_mb=0),
    "time + vision thread": ChatEngineConfig(vision_thread=True, prefix_cache_mb=0),
}


def vision_flood(chat, image, rates: list[float], window_s: float, repeats: int, names: list[str]) -> None:
    modes = {name: FLOOD_MODES[name] for name in names}
    fresh = Fresh()
    for config in modes.values():  # warm-up
        flood_run(chat, config, image, [fresh.chat() for _ in range(4)], 8.0, 0.5, True)
    idle: dict[str, list[float]] = {m: [] for m in modes}
    runs: dict[tuple[float, str, bool], list[FloodRun]] = {}
    loads = []
    for _ in range(repeats):
        for mode, config in modes.items():
            idle[mode] += flood_run(chat, config, image, [], 1.0, window_s, True).gaps
        for rate in rates:
            for mode, config in modes.items():
                for stream in (False, True):
                    prompts = [fresh.chat() for _ in range(math.ceil(rate * window_s))]
                    runs.setdefault((rate, mode, stream), []).append(
                        flood_run(chat, config, image, prompts, rate, window_s, stream)
                    )
        loads.append(os.getloadavg()[0])
    print(
        f"\nvision flood: 8 new images a chat, window {window_s} s, {repeats} repeats, "
        f"load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print("idle stream p99 gap: " + ", ".join(f"{m} {p99(g) * 1e3:.1f} ms ({len(g)} gaps)" for m, g in idle.items()))
    print(
        "\n| flood chats/s | admission | stream p99 gap ms | vs idle | stream p50 gap ms | max gap ms | "
        "flood answered/s alone | with the stream | vs alone |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for mode in modes:
            gaps = [g for r in runs[(rate, mode, True)] for g in r.gaps]

            def answered_per_s(stream: bool) -> float:
                rs = runs[(rate, mode, stream)]
                return sum(r.answered for r in rs) / sum(r.seconds for r in rs)

            alone, beside = answered_per_s(False), answered_per_s(True)
            print(
                f"| {rate:g} | {mode} | {p99(gaps) * 1e3:.1f} | {p99(gaps) / p99(idle[mode]):.2f}x | "
                f"{statistics.median(gaps) * 1e3:.1f} | {max(gaps) * 1e3:.1f} | {alone:.2f} | {beside:.2f} | "
                f"{beside / alone:.2f} |"
            )


def throughput(chat, images, prompts, repeats: int) -> None:
    alone = [chat.run(p) for p in prompts]  # also the warm-up
    modes = ("generate", "one", "batched")
    rates: dict[tuple[int, str], list[float]] = {}
    mismatches = 0
    for _ in range(repeats):
        for n in (1, 4, 8):
            for mode in modes:
                seconds, results = concurrent(chat, prompts[:n], mode)
                rates.setdefault((n, mode), []).append(n * 32 / seconds)
                mismatches += sum(r != a for r, a in zip(results, alone))
    print(
        "| concurrent chats | generate, one at a time (tokens per CPU-s) | engine, max_running_chats=1 | engine, batched | batched / 1 chat batched |"
    )
    print("|---|---|---|---|---|")
    base = statistics.median(rates[(1, "batched")])
    for n in (1, 4, 8):
        m = {mode: statistics.median(rates[(n, mode)]) for mode in modes}
        print(f"| {n} | {m['generate']:.0f} | {m['one']:.0f} | {m['batched']:.0f} | {m['batched'] / base:.2f}x |")
    print(f"\nanswers differing from their generate answer alone: {mismatches} of {repeats * 13 * 3}\n")

    runs = {mb: [five_questions(chat, images[0], mb) for _ in range(repeats)] for mb in (0, 64)}
    print("| question | prefill tokens computed, cache off | on | latency ms, off | on |")
    print("|---|---|---|---|---|")
    for q in range(5):
        off = statistics.median(r[1][q] for r in runs[0]) * 1e3
        on = statistics.median(r[1][q] for r in runs[64]) * 1e3
        print(f"| {q + 1} | {runs[0][0][0][q]} | {runs[64][0][0][q]} | {off:.1f} | {on:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--burst-every-s", type=float, default=0.25)
    ap.add_argument("--only-streaming", action="store_true", help="part 3 only")
    ap.add_argument("--only-flood", action="store_true", help="part 4 only")
    ap.add_argument("--flood-rates", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="chats per second")
    ap.add_argument("--flood-window-s", type=float, default=2.0)
    ap.add_argument("--flood-modes", nargs="+", choices=list(FLOOD_MODES), default=list(FLOOD_MODES))
    args = ap.parse_args()
    chat = family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER}).chat_model()
    images = [render(s, 64) for s in sample_scenes(8, "chat-batching-bench", "heldout")]
    if args.only_flood:
        return vision_flood(chat, images[0], args.flood_rates, args.flood_window_s, args.repeats, args.flood_modes)
    prompts = [ask(QUESTIONS[0], [images[i]], max_tokens=32, ignore_eos=True) for i in range(8)]
    if not args.only_streaming:
        throughput(chat, images, prompts, args.repeats)

    gaps(chat, images, burst=True, every_s=args.burst_every_s)  # warm-up
    idle, busy = [], []
    for _ in range(args.repeats):
        idle += gaps(chat, images, burst=False)
        busy += gaps(chat, images, burst=True, every_s=args.burst_every_s)
    print(
        f"\nstreaming p99 time between tokens: idle {p99(idle) * 1e3:.1f} ms, with 8-image chats arriving "
        f"every {args.burst_every_s} s {p99(busy) * 1e3:.1f} ms ({p99(busy) / p99(idle):.2f}x)"
    )


if __name__ == "__main__":
    main()
