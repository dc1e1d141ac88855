"""TeaCache bookkeeping with a fake family plan: decisions, sub-batching, state lifetime."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from triptych.accel.hooks import RequestStateStore
from triptych.accel.teacache import RowStep, TeaCache, TeaCacheConfig, TeaCachePlan
from triptych.accel.teacache_profile import TeaCacheProfile
from triptych.core.errors import InvalidParam

IDENTITY = (0.0, 0.0, 0.0, 1.0, 0.0)  # polyval(IDENTITY, x) == x


@dataclass
class FakeRow:
    rid: str
    step: int
    x: torch.Tensor
    threshold: float = 0.5
    branch: str = "cond"
    steps: int = 6


@dataclass
class Emb:
    hidden: torch.Tensor


class FakePlan:
    """blocks(h) = 2h + 1, head = identity; records each block call's rows."""

    def __init__(self):
        self.block_rows: list[int] = []
        self.plan = TeaCachePlan("fake", self.describe, self.embed, lambda e: e.hidden, self.blocks, lambda e, h: h)

    @staticmethod
    def describe(r: FakeRow) -> RowStep:
        return RowStep(r.rid, r.branch, r.step, r.steps, r.threshold)

    @staticmethod
    def embed(rows):
        return Emb(torch.cat([r.x for r in rows]))

    def blocks(self, e, idx):
        h = e.hidden if idx is None else e.hidden[idx]
        self.block_rows.append(h.shape[0])
        return 2 * h + 1


def base_forward(rows):
    return 2 * torch.cat([r.x for r in rows]) + 1


def profile(steps=6, warmup=1, cooldown=1):
    return TeaCacheProfile("fake", "m", steps, IDENTITY, warmup, cooldown)


def make(**cfg):
    fake = FakePlan()
    return fake, TeaCache(fake.plan, profiles=lambda steps: profile(steps), config=TeaCacheConfig(**cfg))


def ones(v):
    return torch.full((1, 4), float(v))


def test_threshold_zero_rows_use_base_forward_and_keep_no_state():
    fake, tc = make()
    rows = [FakeRow("a", 0, ones(1), threshold=0), FakeRow("b", 0, ones(2), threshold=0)]
    out = tc.forward(rows, base_forward)
    assert torch.equal(out, base_forward(rows))
    assert fake.block_rows == [] and tc.stats.base_calls == 1 and tc.num_states() == 0


def test_skip_reuses_residual_until_accumulated_reaches_threshold():
    fake, tc = make()
    # inputs 1, 1.1, 1.2, 1.3, ...: rel-L1 ≈ 0.1, 0.09, 0.083 per step; threshold 0.25 → skip, skip, compute
    decisions, outs = [], []
    for step in range(6):
        x = ones(1 + 0.1 * step)
        outs.append(tc.forward([FakeRow("a", step, x, threshold=0.25)], base_forward))
        decisions.append(tc.last_decisions[0].compute)
    assert decisions == [True, False, False, True, False, True]  # last step always computes (cooldown)
    # step 1 skipped: embedded input 1.1 + residual cached at step 0 (2*1+1 - 1 = 2)
    assert torch.allclose(outs[1], ones(1.1 + 2))
    assert torch.allclose(outs[3], ones(2 * 1.3 + 1))


def test_warmup_and_cooldown_always_compute():
    fake, tc = make(warmup_steps=2, cooldown_steps=2)
    decisions = []
    for step in range(6):
        tc.forward([FakeRow("a", step, ones(1), threshold=2.0)], base_forward)  # no change: would always skip
        decisions.append(tc.last_decisions[0].compute)
    assert decisions == [True, True, False, False, True, True]


def test_one_block_call_over_the_computing_rows_only():
    fake, tc = make()
    rows = [FakeRow("a", 0, ones(1)), FakeRow("b", 0, ones(5)), FakeRow("c", 0, ones(9), threshold=0)]
    tc.forward(rows, base_forward)
    step1 = [FakeRow("a", 1, ones(1)), FakeRow("b", 1, ones(10)), FakeRow("c", 1, ones(9), threshold=0)]
    out = tc.forward(step1, base_forward)  # a: no change → skip; b: rel-L1 1.0 ≥ 0.5 → compute; c: threshold 0
    assert fake.block_rows == [3, 2]
    assert [d.compute for d in tc.last_decisions] == [False, True]
    assert torch.allclose(out, torch.cat([ones(3), ones(21), ones(19)]))


def test_all_rows_skip_runs_no_block_call():
    fake, tc = make()
    tc.forward([FakeRow("a", 0, ones(1))], base_forward)
    tc.forward([FakeRow("a", 1, ones(1))], base_forward)
    assert fake.block_rows == [1] and tc.stats.rows_skipped == 1


def test_branches_keep_separate_state():
    fake, tc = make()
    tc.forward([FakeRow("a", 0, ones(1), branch="cond"), FakeRow("a", 0, ones(3), branch="uncond")], base_forward)
    out = tc.forward([FakeRow("a", 1, ones(1), branch="cond"), FakeRow("a", 1, ones(3), branch="uncond")], base_forward)
    assert tc.num_states() == 2
    assert torch.allclose(out, torch.cat([ones(3), ones(7)]))  # each adds its own residual (2 and 4)


def test_release_drops_every_branch_and_unknown_is_noop():
    fake, tc = make()
    tc.forward(
        [FakeRow("a", 0, ones(1), branch="cond"), FakeRow("a", 0, ones(1), branch="uncond"), FakeRow("b", 0, ones(1))],
        base_forward,
    )
    tc.release("a")
    assert tc.num_states() == 1 and tc.active_requests() == ["b"]
    tc.release("b")
    tc.release("never-seen")
    assert tc.num_states() == 0 and tc.active_requests() == []


def test_missing_profile_is_refused_unless_coefficients_given():
    fake = FakePlan()
    tc = TeaCache(fake.plan, profiles=lambda steps: None)
    with pytest.raises(InvalidParam) as e:
        tc.forward([FakeRow("a", 0, ones(1))], base_forward)
    assert e.value.field == "teacache_threshold" and "not calibrated" in str(e.value)
    assert tc.num_states() == 0
    tc.admit("a", threshold=0.5, steps=6, coefficients=IDENTITY)
    tc.forward([FakeRow("a", 0, ones(1))], base_forward)
    assert tc.num_states() == 1


@pytest.mark.parametrize("threshold", [-0.1, float("nan"), 5.0])
def test_bad_threshold_is_refused(threshold):
    fake, tc = make()
    with pytest.raises(InvalidParam):
        tc.admit("a", threshold=threshold, steps=6)


def test_bad_explicit_coefficients_are_refused():
    fake, tc = make()
    with pytest.raises(InvalidParam) as e:
        tc.admit("a", threshold=0.5, steps=6, coefficients=[1.0, 2.0])
    assert e.value.field == "teacache_coefficients"


def test_config_bounds():
    with pytest.raises(ValueError):
        TeaCacheConfig(warmup_steps=-1)


def test_state_store_counts_and_releases():
    store: RequestStateStore[list] = RequestStateStore()
    store.get_or_create("r", "cond", list).append(1)
    assert store.get_or_create("r", "cond", list) == [1]
    store.get_or_create("r", "uncond", list)
    assert ("r", "uncond") in store and len(store) == 2
    assert store.release("r") == 2 and len(store) == 0


def test_family_without_a_plan_is_named():
    from triptych.families.base import Family

    class NoPlan:  # what a family that does not override teacache_plan answers
        name = "no-such-family"

    with pytest.raises(ValueError, match="'no-such-family' has no TeaCache plan"):
        Family.teacache_plan(NoPlan())
