"""TeaCache's residual forecast (profile ``forecast``) with a fake plan whose residual is linear in the
step: order 1 is exact on it, order 0 (the default) is the plain reuse, the state goes on release."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from tests.unit.test_teacache import ones, profile
from triptych.accel.teacache import RowStep, TeaCache, TeaCachePlan

SLOPE, OFFSET = 0.5, 1.0  # residual of step s: OFFSET + SLOPE * s, exact in float32


@dataclass
class Row:
    step: int
    x: torch.Tensor
    threshold: float = 1.0
    steps: int = 8


@dataclass
class Emb:
    hidden: torch.Tensor
    step: torch.Tensor  # (rows, 1)


class LinearPlan:
    """blocks(h) = h + OFFSET + SLOPE * step, head = identity; counts block calls."""

    def __init__(self):
        self.calls = 0
        self.plan = TeaCachePlan("fake", self.describe, self.embed, lambda e: e.hidden, self.blocks, lambda e, h: h)

    @staticmethod
    def describe(r: Row) -> RowStep:
        return RowStep("a", "cond", r.step, r.steps, r.threshold)

    @staticmethod
    def embed(rows):
        return Emb(torch.cat([r.x for r in rows]), torch.tensor([[float(r.step)] for r in rows]))

    def blocks(self, e, idx):
        self.calls += 1
        h, s = (e.hidden, e.step) if idx is None else (e.hidden[idx], e.step[idx])
        return h + OFFSET + SLOPE * s


def exact(step: int) -> torch.Tensor:
    return ones(1) + OFFSET + SLOPE * step


def run(forecast: int, max_skips: int | None = None, warmup: int = 2):
    prof = replace(profile(steps=8, warmup=warmup, cooldown=1), max_skips=max_skips, forecast=forecast)
    fake = LinearPlan()
    tc = TeaCache(fake.plan, profiles=lambda steps: prof)
    outs, decisions = [], []
    for step in range(8):  # the same input every step: every step the profile allows skips
        outs.append(tc.forward([Row(step, ones(1))], lambda rows: None))
        decisions.append(tc.last_decisions[0].compute)
    return tc, outs, decisions


@pytest.mark.parametrize("max_skips", [None, 1, 2])
def test_linear_forecast_is_exact_on_a_residual_linear_in_the_step(max_skips):
    tc, outs, decisions = run(forecast=1, max_skips=max_skips)
    assert decisions.count(False) >= 3  # skips happened, at gaps of 1 (no cap) to 2 steps (cap 1)
    for step, out in enumerate(outs):
        assert torch.equal(out, exact(step)), step


def test_default_reuses_the_last_residual_and_keeps_no_earlier_one():
    tc, outs, decisions = run(forecast=0)
    assert decisions == [True, True, False, False, False, False, False, True]
    assert all(torch.equal(outs[s], exact(1)) for s in range(2, 7))  # step 1's residual, as before
    assert not torch.equal(outs[2], exact(2))
    assert tc._states.get("a", "cond").earlier_residual is None


def test_forecast_with_one_residual_known_reuses_it():
    _, outs, decisions = run(forecast=1, warmup=1)
    assert decisions[:2] == [True, False] and torch.equal(outs[1], exact(0))


def test_release_drops_the_forecast_state():
    tc, _, _ = run(forecast=1, max_skips=1)
    assert tc._states.get("a", "cond").earlier_residual is not None
    tc.release("a")
    assert tc.num_states() == 0 and tc.active_requests() == []
