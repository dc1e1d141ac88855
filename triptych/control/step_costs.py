"""What a denoising step costs, learned from what the denoisers report, and when a request would
finish: the head's estimate behind a deadline's refusal (``Orchestrator.check_deadlines``).

``StepCosts`` keeps, per shape ``(height, width, frames)`` of one served model (each model has its
own orchestrator, so its own costs) and per batch occupancy (requests stepped together in one
engine tick), an exponentially weighted mean of the seconds one tick took, as the denoisers report
it (``DenoiseDone.tick_s`` and ``occupancy``: the mean over the ticks that stepped one request).
A request in a batch of n advances one step per tick, so its step costs the tick's time t(n) and
the engine's throughput is n / t(n) request steps per second. An occupancy not measured for a
shape is priced from the nearest measured one, as a lower bound (a batch is never faster than a
smaller one, and never costs more per request): below the smallest measured m, ``t(m) * n / m``;
above the largest, t(largest); between two measured ones, linearly. A shape not measured at all
costs ``prior_s`` per tick until its first report.

``finish_estimate``: a request beside the ones ahead of it runs at the occupancy they make
together on the denoisers (at most the slots of one); it finishes no sooner than its own steps at
that occupancy's tick time, nor sooner than the denoisers get through the work ahead of it and its
own at that occupancy's throughput. Encode and decode are not counted: the estimate errs towards
admitting.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

Shape = tuple[int, int, int | None]  # (height, width, frames)


@dataclass
class StepCosts:
    prior_s: float = 0.5  # seconds per tick of a shape not measured yet
    alpha: float = 0.3  # weight of the newest report in the running mean
    learned: dict[Shape, dict[int, float]] = field(default_factory=dict)  # shape -> occupancy -> tick seconds

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prior_s) and self.prior_s > 0) or not 0 < self.alpha <= 1:
            raise ValueError(f"StepCosts: prior_s={self.prior_s!r} must be > 0 and alpha={self.alpha!r} in (0, 1]")

    def learn(self, shape: Shape, tick_s: float, occupancy: float) -> None:
        """A request of ``shape`` stepped in ticks of ``tick_s`` seconds with ``occupancy`` requests
        in each (means over its ticks; the occupancy is rounded). Ignored unless both are positive."""
        if not (math.isfinite(tick_s) and tick_s > 0 and math.isfinite(occupancy) and occupancy > 0):
            return
        table = self.learned.setdefault(shape, {})
        n = max(1, round(occupancy))
        old = table.get(n)
        table[n] = tick_s if old is None else (1 - self.alpha) * old + self.alpha * tick_s

    def step_s(self, shape: Shape, occupancy: int = 1) -> float:
        """Seconds of one tick of ``occupancy`` requests of ``shape`` (one step of each of them)."""
        table = self.learned.get(shape)
        if not table:
            return self.prior_s
        n = max(1, occupancy)
        if n in table:
            return table[n]
        measured = sorted(table)
        at = bisect.bisect(measured, n)
        if at == 0:
            m = measured[0]
            return table[m] * n / m
        if at == len(measured):
            return table[measured[-1]]
        lo, hi = measured[at - 1], measured[at]
        return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


def shape_of(p) -> Shape:
    """The key of a request's step cost: its resolved ``GenerationParams``' size and frames."""
    return (int(p.height), int(p.width), p.frames)


def occupancy(ahead: int, slots: int, denoisers: int) -> int:
    """Requests per tick on a denoiser when ``ahead`` requests and one more share ``denoisers`` with
    ``slots`` places in all: spread evenly, at most one denoiser's places."""
    d = max(1, denoisers)
    return max(1, min(math.ceil((ahead + 1) / d), math.ceil(max(1, slots) / d)))


def finish_estimate(
    costs: StepCosts, ahead: Iterable[tuple[Shape, float]], own: tuple[Shape, int], slots: int, denoisers: int = 1
) -> float:
    """Seconds until a request ``own`` = (shape, steps) would finish denoising beside ``ahead``
    ((shape, steps left) of each request before it) on ``denoisers`` with ``slots`` places in all."""
    ahead = list(ahead)
    n = occupancy(len(ahead), slots, denoisers)
    shape, steps = own
    step: dict[Shape, float] = {}  # shape -> costs.step_s(shape, n), once per shape
    work = 0.0
    for s, left in ahead:
        cost = step.get(s)
        if cost is None:
            cost = step[s] = costs.step_s(s, n)
        work += cost * max(0.0, left)
    work += costs.step_s(shape, n) * steps
    return max(costs.step_s(shape, n) * steps, work / n / max(1, denoisers))
