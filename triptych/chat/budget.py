"""What a chat step's work costs, estimated online (``StepCosts``), so that a step admits vision
encode and prefill by time rather than by item counts (no torch: plain arithmetic).

Three kinds of work, each with its own unit and one exponential moving average of seconds per unit:

- ``decode``: one decode forward of the running chats (unit: the step),
- ``vision``: the vision tower on an image (unit: one of its tokens after the merger),
- ``prefill``: prompt tokens through the model (unit: a token; a mixed forward's share is its
  wall time less the decode estimate).

A kind not measured yet has no estimate (``known`` is False; ``estimate`` is infinite), so its
first item runs alone and seeds it. The engine turns the decode estimate into a step's budget
(``ChatEngineConfig.step_time_budget`` times it)."""

from __future__ import annotations

import math

KINDS = ("decode", "vision", "prefill")


class StepCosts:
    """Seconds per unit of each kind, an EMA over the measurements ``observe`` gets (the first one
    seeds it). One engine owns one; the encoder layer may share it (its tower runs are ``vision``)."""

    def __init__(self, alpha: float = 0.25):
        if not 0 < alpha <= 1:
            raise ValueError(f"StepCosts alpha={alpha!r}: must be in (0, 1]")
        self.alpha = alpha
        self.per_unit: dict[str, float] = {}

    def known(self, kind: str) -> bool:
        return kind in self.per_unit

    def estimate(self, kind: str, units: float = 1.0) -> float:
        """Seconds ``units`` of ``kind`` are expected to take (infinite while unmeasured; 0 units: 0)."""
        if units <= 0:
            return 0.0
        per = self.per_unit.get(kind)
        return math.inf if per is None else per * units

    def observe(self, kind: str, units: float, seconds: float) -> None:
        """``units`` of ``kind`` took ``seconds`` (no units: nothing learnt)."""
        assert kind in KINDS, kind
        if units <= 0 or not math.isfinite(seconds):
            return
        per = max(0.0, seconds) / units
        old = self.per_unit.get(kind)
        self.per_unit[kind] = per if old is None else old + self.alpha * (per - old)
