"""What a denoising step costs, learned from what the denoisers report, and when a request would
finish: the head's estimate behind a deadline's refusal (``Orchestrator.check_deadlines``).

``StepCosts`` keeps, per shape ``(height, width, frames)`` of one served model (each model has its
own orchestrator, so its own costs), an exponentially weighted mean of the seconds one step of one
request took in the engine (a request's time from joining the engine to its last step over its
steps, as its denoiser measured it: batching with others is in it). A shape not measured yet costs
``prior_s`` per step until its first report.

``finish_estimate``: the request waits for the work ahead of it (each request ahead: its steps
left times its shape's cost), spread over the denoisers' slots, then runs its own steps. Encode and
decode are not counted: the estimate errs towards admitting.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

Shape = tuple[int, int, int | None]  # (height, width, frames)


@dataclass
class StepCosts:
    prior_s: float = 0.5  # seconds per step of a shape not measured yet
    alpha: float = 0.3  # weight of the newest report in the running mean
    learned: dict[Shape, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prior_s) and self.prior_s > 0) or not 0 < self.alpha <= 1:
            raise ValueError(f"StepCosts: prior_s={self.prior_s!r} must be > 0 and alpha={self.alpha!r} in (0, 1]")

    def learn(self, shape: Shape, step_s: float) -> None:
        """One request of ``shape`` took ``step_s`` seconds per step (ignored unless positive)."""
        if not (math.isfinite(step_s) and step_s > 0):
            return
        old = self.learned.get(shape)
        self.learned[shape] = step_s if old is None else (1 - self.alpha) * old + self.alpha * step_s

    def step_s(self, shape: Shape) -> float:
        return self.learned.get(shape, self.prior_s)


def shape_of(p) -> Shape:
    """The key of a request's step cost: its resolved ``GenerationParams``' size and frames."""
    return (int(p.height), int(p.width), p.frames)


def finish_estimate(
    costs: StepCosts, ahead: Iterable[tuple[Shape, float]], own: tuple[Shape, int], slots: int
) -> float:
    """Seconds until a request ``own`` = (shape, steps) would finish denoising: the work of ``ahead``
    ((shape, steps left) of each request before it) over ``slots`` parallel places, plus its own."""
    wait = sum(costs.step_s(shape) * max(0.0, steps) for shape, steps in ahead) / max(1, slots)
    shape, steps = own
    return wait + costs.step_s(shape) * steps
