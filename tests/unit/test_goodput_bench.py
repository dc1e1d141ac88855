"""benchmarks/goodput.py's pure parts: the seeded Poisson arrival schedule, and goodput / SLO
attainment / latency percentiles computed from fake records."""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("goodput_bench", ROOT / "benchmarks" / "goodput.py")
goodput = importlib.util.module_from_spec(spec)
sys.modules["goodput_bench"] = goodput  # dataclasses look their module up
spec.loader.exec_module(goodput)

Record = goodput.Record


def test_poisson_schedule_is_seeded_increasing_and_inside_the_window():
    a = goodput.poisson_schedule(4.0, 50.0, random.Random(7))
    assert a == goodput.poisson_schedule(4.0, 50.0, random.Random(7))
    assert a != goodput.poisson_schedule(4.0, 50.0, random.Random(8))
    assert all(0 < x < 50.0 for x in a)
    assert all(x < y for x, y in zip(a, a[1:]))


def test_poisson_schedule_has_the_rate_and_exponential_gaps():
    rate, span = 5.0, 2000.0
    a = goodput.poisson_schedule(rate, span, random.Random(1))
    # 10,000 arrivals expected, standard deviation 100: within 4 of them
    assert abs(len(a) - rate * span) < 400, len(a)
    gaps = [y - x for x, y in zip(a, a[1:])]
    # exponential: the standard deviation equals the mean (a fixed-interval clock would give 0)
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)


def test_poisson_schedule_rejects_a_non_positive_rate():
    with pytest.raises(ValueError, match="rate=0"):
        goodput.poisson_schedule(0, 10.0, random.Random(0))


def test_summarize_counts_goodput_attainment_refusals_and_drops():
    records = [
        Record("interactive", 200, 0.4, 1.0),  # good
        Record("interactive", 200, 1.5, 1.0),  # answered, but late: not good
        Record("interactive", 429, 0.01, 1.0),  # refused
        Record("batch", 200, 9.0, 10.0),  # good
        Record("batch", 504, 10.2, 10.0),  # dropped
        Record("batch", 0, 11.0, 10.0),  # no answer before the drain ended
    ]
    s = goodput.summarize(records, window_s=2.0)
    assert (s["sent"], s["good"]) == (6, 2)
    assert s["goodput_rps"] == 1.0  # 2 good over a 2 s window
    assert (s["refused_429"], s["dropped_504"]) == (1, 1)
    i, b = s["classes"]["interactive"], s["classes"]["batch"]
    assert i["attainment"] == pytest.approx(1 / 3) and b["attainment"] == pytest.approx(1 / 3)
    assert (i["refused_429"], i["dropped_504"], b["refused_429"], b["dropped_504"]) == (1, 0, 0, 1)
    assert b["other_fail"] == 1
    # latency percentiles are over the 200s only: a refusal's fast answer is not a latency
    assert i["p50_s"] == pytest.approx(0.95) and b["p50_s"] == 9.0
    assert "chat" not in s["classes"]


def test_percentile_interpolates_and_is_none_when_empty():
    xs = [float(v) for v in range(1, 101)]  # 1..100
    assert goodput.percentile(xs, 0.5) == pytest.approx(50.5)
    assert goodput.percentile(xs, 0.99) == pytest.approx(99.01)
    assert goodput.percentile([], 0.5) is None


def test_ratios_put_each_load_slo_goodput_over_fcfs():
    def w(x, mode, g):
        return {"load_x": x, "mode": mode, "summary": {"goodput_rps": g}}

    result = {"windows": [w(1.2, "slo", 3.0), w(1.2, "fcfs", 2.0), w(0.5, "fcfs", 0.0), w(0.5, "slo", 1.0)]}
    assert goodput.ratios(result) == {"1.2": 1.5, "0.5": None}
