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
size the fit is undetermined and the per-unit average alone prices the work.

A call whose fitted overhead is above the step's budget runs past it whatever it holds, so
``call_allowance`` lets it hold more work, up to ``stretch`` times that overhead of per-unit work:
few long calls instead of many calls each nearly as long (the tower's batched forward of eight
images against eight single ones).

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
        self.observed: dict[str, int] = {}  # kind -> measurements taken

    def fitted(self, kind: str) -> bool:
        """Whether calls of different sizes have told the per-call term apart from the per-unit one."""
        return kind in self.per_call

    def call_allowance(self, kind: str, budget_s: float, stretch: float) -> float:
        """Seconds one call of ``kind`` may be estimated at in a step of ``budget_s``: the budget,
        or where the fitted per-call overhead alone is over it, ``(1 + stretch)`` times that
        overhead (the call's per-unit work may add up to ``stretch`` overheads)."""
        per_call = self.per_call.get(kind)
        if per_call is None or not math.isfinite(budget_s):
            return budget_s
        return max(budget_s, (1 + stretch) * per_call)

    def known(self, kind: str) -> bool:
        return kind in self.per_unit

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
        self.observed[kind] = self.observed.get(kind, 0) + 1
        sums = self._sums.setdefault(kind, [0.0] * 5)
        d = self.fit_decay
        for i, v in enumerate((calls * calls, calls * units, units * units, calls * seconds, units * seconds)):
            sums[i] = d * sums[i] + v
        fit = _fit(sums)
        if fit is not None:
            self.per_call[kind], self.per_unit[kind] = fit
            return
        self.per_call.pop(kind, None)
        per = seconds / units
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
