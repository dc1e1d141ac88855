"""What a window of requests got, summarized the same way for a measured run (benchmarks/goodput.py)
and a simulated one: goodput, SLO attainment per class, latency percentiles, refusals."""

from __future__ import annotations

from dataclasses import dataclass

from triptych.sim.workload import CLASSES


@dataclass
class Record:
    """What one request got: ``status`` (an HTTP code, or 0 when it had no answer in time),
    ``latency_s`` from its scheduled arrival, its ``slo_s``."""

    cls: str
    status: int
    latency_s: float
    slo_s: float

    @property
    def good(self) -> bool:
        return self.status == 200 and self.latency_s <= self.slo_s


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation between order statistics; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records: list[Record], window_s: float) -> dict:
    """Goodput (within-SLO 200s per second of the window), and per class: sent, good, attainment
    (good / sent), p50/p99 latency of its 200s, refused (429), dropped (504), other failures."""
    per = {}
    for cls in CLASSES:
        rs = [r for r in records if r.cls == cls]
        if not rs:
            continue
        ok = [r.latency_s for r in rs if r.status == 200]
        good = sum(r.good for r in rs)
        per[cls] = {
            "sent": len(rs),
            "good": good,
            "attainment": good / len(rs),
            "p50_s": percentile(ok, 0.5),
            "p99_s": percentile(ok, 0.99),
            "refused_429": sum(r.status == 429 for r in rs),
            "dropped_504": sum(r.status == 504 for r in rs),
            "other_fail": sum(r.status not in (200, 429, 504) for r in rs),
        }
    good = sum(r.good for r in records)
    return {
        "sent": len(records),
        "good": good,
        "goodput_rps": good / window_s,
        "attainment": good / len(records) if records else None,
        "refused_429": sum(r.status == 429 for r in records),
        "dropped_504": sum(r.status == 504 for r in records),
        "classes": per,
    }
