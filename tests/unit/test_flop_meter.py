"""Serving's FLOP meter: the denoiser engine, the encode and the decode count what ``triptych plan``
predicts for the same request (the default model, in process); TeaCache-skipped rows count nothing;
the head's counter and MFU gauge read the workers' windows."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import triptych
from triptych.control.metrics_flops import WINDOW_S, FlopMetrics
from triptych.plan.compute_stats import ComputeStats

DEFAULT = Path(triptych.__file__).parent / "assets" / "default"


@pytest.fixture(scope="module")
def default_family():
    from triptych.families.registry import load_family

    return load_family(DEFAULT)


def _served(family, params):
    """FLOPs the engine, encoder and decoder meters count for one request, and its prompt lengths."""
    from triptych.engine import DenoiserEngine
    from triptych.plan.costs import DecodeCosts, EncodeCosts, RowCosts

    cond = family.encode(params)
    lengths = {b: v["prompt_embeds"].shape[1] for b, v in cond.branches.items()}
    engine = DenoiserEngine(family)
    engine.flop_costs = RowCosts(family)
    engine.add(family.prepare("r", params, cond))
    while engine.has_work():
        engine.step()
    return engine.stats, EncodeCosts(family).cost(cond), DecodeCosts(family).cost(params), lengths


def test_a_served_request_counts_what_plan_predicts(default_family):
    from triptych.families.base import COND, UNCOND, GenerationParams
    from triptych.plan.model_plan import Request, plan

    params = default_family.resolve(GenerationParams(prompt="a red circle", steps=3))
    stats, encode, decode, lengths = _served(default_family, params)
    assert stats.rows == 6  # 3 steps x 2 CFG branches, one fused forward each
    predicted = plan(DEFAULT, Request(steps=3, text_tokens=lengths[COND], negative_text_tokens=lengths[UNCOND]))
    s = predicted["stages"]
    # measured: equal (the same module and shapes traced); 1% allowed
    assert stats.flops == pytest.approx(3 * s["denoise_step"]["flops"], rel=0.01)
    assert encode == pytest.approx(s["encode"]["flops"], rel=0.01)
    assert decode == pytest.approx(s["decode"]["flops"], rel=0.01)
    assert stats.flops + encode + decode == pytest.approx(predicted["request_flops"], rel=0.01)


def test_rows_teacache_skips_count_nothing(default_family):
    """A cache that skips every row of one call: the engine counts only the rows that ran."""
    from triptych.engine import DenoiserEngine
    from triptych.families.base import GenerationParams
    from triptych.plan.costs import RowCosts

    class SkipSecond:
        """Stands in for TeaCache: runs every forward, reports the rows of its second call as skipped."""

        def __init__(self):
            self.calls = 0
            self.stats = type("S", (), {"rows_skipped": 0})()

        def admit(self, *a):
            pass

        def release(self, rid):
            pass

        def forward(self, rows, base):
            self.calls += 1
            if self.calls == 2:
                self.stats.rows_skipped += len(rows)
            return base(rows)

    params = default_family.resolve(GenerationParams(prompt="a red circle", steps=3))
    cond = default_family.encode(params)
    plain = DenoiserEngine(default_family)
    cached = DenoiserEngine(default_family, accel=SkipSecond())
    for engine in (plain, cached):
        engine.flop_costs = RowCosts(default_family)
        engine.add(default_family.prepare("r", params, cond))
        while engine.has_work():
            engine.step()
    assert plain.stats.flops > 0
    assert cached.stats.flops == pytest.approx(plain.stats.flops * 2 / 3, rel=1e-9)  # one step of three skipped


def _sample(registry, name, labels=None):
    return registry.get_sample_value(name, labels or {})


def test_the_head_counts_flops_and_rates_them_against_the_peak():
    registry = CollectorRegistry()
    m = FlopMetrics(registry)
    m.record("denoiser", "den-0", ComputeStats(model="x", flops=3e12, peak_flops=1e12), seconds=10.0, now=100.0)
    m.record("denoiser", "den-0", ComputeStats(model="x", flops=1e12, peak_flops=1e12), seconds=10.0, now=110.0)
    assert _sample(registry, "triptych_denoiser_flops_total") == 4e12
    assert _sample(registry, "triptych_denoiser_mfu", {"instance": "den-0"}) == pytest.approx(0.2)  # 4e12 / 20 s / 1e12
    # the first window leaves the average once it is older than the window
    m.record(
        "denoiser", "den-0", ComputeStats(model="x", flops=0, peak_flops=1e12), seconds=10.0, now=100.0 + WINDOW_S + 1
    )
    assert _sample(registry, "triptych_denoiser_mfu", {"instance": "den-0"}) == pytest.approx(1e12 / 20 / 1e12)
    m.record("encoder", "enc-0", ComputeStats(model="x", flops=5.0, peak_flops=0.0), seconds=1.0, now=100.0)
    assert _sample(registry, "triptych_encoder_flops_total") == 5.0
    assert _sample(registry, "triptych_encoder_mfu", {"instance": "enc-0"}) is None  # no peak known: no gauge
