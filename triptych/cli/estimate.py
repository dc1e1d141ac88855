"""The time a long ``triptych generate`` will take, said once its first step has been measured.

A step of a request costs about the same as every other (same size, same batch), so the first
step's time (from the start of the encode, so a little over a step) times the steps left is the
estimate; it is printed before the remaining steps run, only when it is at least ``LONG_S``, so a
request that would run for an hour says so after one step instead of after the hour.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Estimates below this many seconds are not printed (a short run needs no warning).
LONG_S = 30.0


def duration(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``1.6 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class StepEstimate:
    """``started()`` before the request runs; ``step(done, total)`` after each of its steps. After
    the first, ``say`` gets one line with the estimate when it is at least ``long_s``."""

    def __init__(
        self, say: Callable[[str], None], long_s: float = LONG_S, clock: Callable[[], float] = time.perf_counter
    ):
        self.say, self.long_s, self.clock = say, long_s, clock
        self.t0: float | None = None
        self.estimate_s: float | None = None

    def started(self) -> None:
        self.t0 = self.clock()

    def step(self, done: int, total: int) -> None:
        if done != 1 or self.t0 is None or self.estimate_s is not None:
            return
        per_step = self.clock() - self.t0
        self.estimate_s = per_step * (total - 1)
        if self.estimate_s >= self.long_s:
            self.say(
                f"estimate: about {duration(self.estimate_s)} more for the {total - 1} steps left "
                f"({duration(per_step)} for the first); Ctrl-C stops it"
            )
