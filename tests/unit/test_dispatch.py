"""Dispatch policies pick only instances with a free slot."""

from __future__ import annotations

import pytest

from triptych.control.dispatch import Instance, MaxFreeSlots, RoundRobin, make_policy


def inst(name: str, capacity: int = 2, held: int = 0) -> Instance:
    i = Instance(name, "denoiser", capacity, "ctl", "tcp://x", "zmq", 1, 0.0)
    for n in range(held):
        i.hold(f"{name}-r{n}")
    return i


def test_round_robin_cycles_in_id_order():
    pool = [inst("b"), inst("a"), inst("c")]
    rr = RoundRobin()
    assert [rr.pick(pool).instance_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_round_robin_skips_full_instances():
    pool = [inst("a", held=2), inst("b")]
    rr = RoundRobin()
    assert [rr.pick(pool).instance_id for _ in range(2)] == ["b", "b"]


def test_max_free_slots_prefers_most_free():
    pool = [inst("a", capacity=4, held=3), inst("b", capacity=4, held=1)]
    assert MaxFreeSlots().pick(pool).instance_id == "b"


def test_max_free_slots_ties_alternate():
    pool = [inst("a"), inst("b")]
    policy = MaxFreeSlots()
    assert {policy.pick(pool).instance_id for _ in range(2)} == {"a", "b"}


@pytest.mark.parametrize("name", ["round_robin", "max_free_slots"])
def test_no_free_capacity_gives_none(name):
    assert make_policy(name).pick([inst("a", held=2), inst("b", capacity=1, held=1)]) is None
    assert make_policy(name).pick([]) is None


@pytest.mark.parametrize("name", ["round_robin", "max_free_slots"])
def test_excluded_instances_are_never_picked(name):
    pool = [inst("a"), inst("b")]
    policy = make_policy(name)
    assert {policy.pick(pool, exclude=frozenset({"a"})).instance_id for _ in range(3)} == {"b"}


def test_hold_and_unhold_track_free_slots():
    i = inst("a", capacity=1)
    i.hold("r1")
    assert i.free == 0
    assert i.unhold("r1") and not i.unhold("r1")
    assert i.free == 1


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")


@pytest.mark.parametrize("policy", ["round_robin", "max_free_slots"])
def test_no_policy_picks_a_draining_instance(policy):
    draining = inst("a", capacity=8)
    draining.draining = True
    pool = [draining, inst("b", held=2)]
    assert make_policy(policy).pick(pool) is None  # the only free slots are on the draining one
    pool.append(inst("c"))
    assert make_policy(policy).pick(pool).instance_id == "c"
