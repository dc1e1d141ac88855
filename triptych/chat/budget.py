"""What a chat step's work costs, estimated online (``StepCosts``), so that a step admits vision
encode and prefill by time rather than by item counts (no torch: plain arithmetic).

Three kinds of work, each with its own unit:

- ``decode``: one decode forward of the running chats (unit: the step),
- ``vision``: the vision tower on images (unit: one of its tokens after the merger; a call may hold
  many images),
- ``prefill``: prompt tokens through the model (unit: a token; a mixed forward's share is its
  wall time less the decode estimate).

Each kind has an exponential moving average of seconds per unit. Where the measured calls differ
in size (a tower call of one image and one of eight), each kind also has a per-call term: a
weighted least-squares fit of ``seconds = per_call * calls + per_unit * units`` over the recent
calls (older ones weigh ``fit_decay`` times less per call), so a batched call is priced as one
overhead plus its tokens rather than as many single calls. While the calls seen are all of one
size the fit is undetermined: the per-unit average alone prices the work, or, with a per-call
term fitted before, the per-unit average of what each call took beyond it.

A call that must run past the step's budget (an image's tower, atomic, over one decode step) may
hold more work (``call_allowance``): up to ``stretch`` times its own estimate more, priced with the
per-call term where fitted, so an overhead-bound tower takes many images in one call: few long
stalls instead of many nearly as long (the tower's batched forward of eight images against eight
single ones).

A kind not measured yet has no estimate (``known`` is False; ``estimate`` is infinite), so its
first item runs alone and seeds it. The engine turns the decode estimate into a step's budget
(``ChatEngineConfig.step_time_budget`` times it)."""

from __future__ import annotations

import math

KINDS = ("decode", "vision", "prefill")
#: the fit is used once the spread of the units per call is at least this fraction of their scale
#: (the normal equations' determinant over the product of their diagonal)
SPREAD = 1e-3


class StepCosts:
    """Seconds per unit (and per call, once fitted) of each kind, learnt from what ``observe``
    gets (the first one seeds it). One engine owns one; the encoder layer may share it (its tower
    runs are ``vision``)."""

    def __init__(self, alpha: float = 0.25, fit_decay: float = 0.95):
        if not 0 < alpha <= 1:
            raise ValueError(f"StepCosts alpha={alpha!r}: must be in (0, 1]")
        if not 0 < fit_decay <= 1:
            raise ValueError(f"StepCosts fit_decay={fit_decay!r}: must be in (0, 1]")
        self.alpha = alpha
        self.fit_decay = fit_decay
        self.per_unit: dict[str, float] = {}
        self.per_call: dict[str, float] = {}  # kinds whose fit is determined: seconds per call
        self._sums: dict[str, list[float]] = {}  # kind -> decayed [cc, cu, uu, cs, us]

    def known(self, kind: str) -> bool:
        return kind in self.per_unit

    def fitted(self, kind: str) -> bool:
        """Whether calls of different sizes have told the per-call term apart from the per-unit one."""
        return kind in self.per_call

    def call_allowance(self, kind: str, budget_s: float, forced_units: float, stretch: float) -> float:
        """Seconds one call of ``kind`` may be estimated at in a step of ``budget_s`` when it must
        hold ``forced_units``: the budget, or where those alone are estimated over it (the call
        runs past the budget anyway), ``(1 + stretch)`` times their estimate. With a fitted
        per-call overhead the added units pay only their per-unit price, so an overhead-bound call
        takes many more."""
        forced = self.estimate(kind, forced_units)
        if not math.isfinite(budget_s) or not math.isfinite(forced) or forced <= budget_s:
            return budget_s
        return (1 + stretch) * forced

    def estimate(self, kind: str, units: float = 1.0, calls: int = 1) -> float:
        """Seconds ``units`` of ``kind`` in ``calls`` calls are expected to take (infinite while
        unmeasured; 0 units: 0)."""
        if units <= 0:
            return 0.0
        per = self.per_unit.get(kind)
        if per is None:
            return math.inf
        return per * units + self.per_call.get(kind, 0.0) * calls

    def observe(self, kind: str, units: float, seconds: float, calls: int = 1) -> None:
        """``units`` of ``kind`` in ``calls`` calls took ``seconds`` (no units: nothing learnt)."""
        assert kind in KINDS, kind
        if units <= 0 or calls <= 0 or not math.isfinite(seconds):
            return
        seconds = max(0.0, seconds)
        sums = self._sums.setdefault(kind, [0.0] * 5)
        d = self.fit_decay
        for i, v in enumerate((calls * calls, calls * units, units * units, calls * seconds, units * seconds)):
            sums[i] = d * sums[i] + v
        fit = _fit(sums)
        if fit is not None:
            self.per_call[kind], self.per_unit[kind] = fit
            return
        # the recent calls are all of one size: a per-call term found before stays, and the
        # per-unit average follows what is left of each call
        per = max(0.0, seconds - self.per_call.get(kind, 0.0) * calls) / units
        old = self.per_unit.get(kind)
        self.per_unit[kind] = per if old is None else old + self.alpha * (per - old)


def _fit(sums: list[float]) -> tuple[float, float] | None:
    """(seconds per call, per unit) minimising the weighted squared error, both >= 0; None when the
    calls seen do not tell the two apart (all of one size)."""
    cc, cu, uu, cs, us = sums
    det = cc * uu - cu * cu
    if det <= SPREAD * cc * uu:
        return None
    per_call = (uu * cs - cu * us) / det
    per_unit = (cc * us - cu * cs) / det
    if per_call < 0:  # the best fit through the origin
        return 0.0, max(0.0, us / uu)
    if per_unit < 0:
        return max(0.0, cs / cc), 0.0
    return per_call, per_unit
