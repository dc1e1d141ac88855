"""The goodput workload (benchmarks/goodput.py's, shared with the simulator so both draw the same
requests from the same seed): Poisson arrival offsets and a seeded mix of request classes, sizes
and step counts."""

from __future__ import annotations

import random
from dataclasses import dataclass

CLASSES = ("interactive", "batch", "chat")
PRIORITY = {"interactive": 0, "batch": 10, "chat": 0}


def poisson_schedule(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets (seconds from the window's start, increasing, all < ``duration_s``) of a
    Poisson process of ``rate`` per second: exponential gaps of mean ``1 / rate``."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"poisson_schedule: rate={rate!r} and duration_s={duration_s!r} must be > 0")
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class Spec:
    """One request of the workload: its class and shape ((0, 0) for a chat)."""

    cls: str
    size: int
    steps: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.size, self.steps)


def draw_specs(n: int, rng: random.Random, sizes, steps, batch_share: float, chat_share: float) -> list[Spec]:
    out = []
    for _ in range(n):
        if rng.random() < chat_share:
            out.append(Spec("chat", 0, 0))
            continue
        cls = "batch" if rng.random() < batch_share else "interactive"
        out.append(Spec(cls, rng.choice(sizes), rng.choice(steps)))
    return out
