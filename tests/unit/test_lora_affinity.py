"""The head's LoRA affinity: a request goes to a free denoiser that reported holding its adapters,
before the dispatch policy's own choice; otherwise the policy chooses as usual."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from triptych.control import protocol as P
from triptych.control.attempts import Attempts
from triptych.control.counters import LifecycleCounters
from triptych.control.dispatch import Instance, MaxFreeSlots, RoundRobin
from triptych.control.request_state import StateTimeouts
from triptych.control.routing import GenerationRouter
from triptych.engine.stats import EngineStats
from triptych.families.types import GenerationParams
from triptych.transfer.stats import TransferStats


def den(name: str, loras=(), capacity: int = 4, held: int = 0) -> Instance:
    i = Instance(name, "denoiser", capacity, "ctl", "tcp://x", "zmq", 1, 0.0)
    i.stats = P.StatsReport(
        instance_id=name,
        uptime_s=1.0,
        engine=EngineStats(lora_resident=list(loras)),
        transfer=TransferStats(backend="zmq"),
    )
    for n in range(held):
        i.hold(f"{name}-r{n}")
    return i


@pytest.mark.parametrize("policy", [MaxFreeSlots, RoundRobin])
def test_the_holder_of_the_adapter_is_chosen_over_the_policys_pick(policy):
    # the policy alone picks "a" (more free slots / first in id order); "b" holds the adapter
    pool = [den("a"), den("b", loras=["style"], held=3)]
    assert policy().pick(pool).instance_id == "a"
    assert Attempts().pick(policy(), "denoiser", pool, loras=["style"]).instance_id == "b"


def test_the_denoiser_holding_more_of_a_stacked_request_wins():
    pool = [den("a", loras=["x"]), den("b", loras=["x", "y"], held=2), den("c")]
    assert Attempts().pick(MaxFreeSlots(), "denoiser", pool, loras=["x", "y"]).instance_id == "b"


@pytest.mark.parametrize("why", ["full", "draining", "failed it"])
def test_a_holder_that_cannot_take_it_leaves_the_choice_to_the_policy(why):
    holder = den("b", loras=["style"], held=4 if why == "full" else 0)
    holder.draining = why == "draining"
    attempts = Attempts(avoid={"denoiser": {"b"}} if why == "failed it" else {})
    pool = [den("a", held=1), holder]
    assert attempts.pick(MaxFreeSlots(), "denoiser", pool, loras=["style"]).instance_id == "a"


def test_without_adapters_or_holders_the_policy_chooses():
    pool = [den("a", held=2), den("b", loras=["other"])]
    assert Attempts().pick(MaxFreeSlots(), "denoiser", pool, loras=["style"]).instance_id == "b"
    pool = [den("a"), den("b", loras=["style"], held=3)]
    assert Attempts().pick(MaxFreeSlots(), "denoiser", pool).instance_id == "a"


def test_the_router_prefers_the_holder_for_the_denoiser_only():
    pool = [den("a"), den("b", loras=["style"], held=3)]
    policies = {"denoiser": MaxFreeSlots(), "decoder": MaxFreeSlots()}
    registry = SimpleNamespace(policies=policies, pool=lambda role: pool, affinity=None)
    router = GenerationRouter(
        registry=registry,
        send=lambda *a: None,
        metrics=None,
        counters=LifecycleCounters(),
        timeouts=StateTimeouts(),
        max_retries=0,
        max_queued=1,
        reserve_timeout_s=1.0,
        replacement_wait_s=0.0,
    )
    params = GenerationParams(prompt="x", lora=(("style", 1.0),))
    tr = SimpleNamespace(job=SimpleNamespace(params=params), attempts=Attempts())
    assert router._pick("denoiser", tr).instance_id == "b"
    assert router._pick("decoder", tr).instance_id == "a"  # decoders hold no adapters
