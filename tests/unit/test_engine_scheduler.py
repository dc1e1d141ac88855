"""Batch selection and fairness of the denoiser engine, with 10-line fakes."""

from __future__ import annotations

from types import SimpleNamespace

from triptych.engine.config import EngineConfig
from triptych.engine.scheduler import Running, pick_batch


def fake(rid: str, key: str, tokens: int = 16, last_tick: int = 0, arrival: int = 0, branches: int = 1):
    cond = SimpleNamespace(branches={f"b{i}": {} for i in range(branches)})
    return Running(SimpleNamespace(request_id=rid, cond=cond), key, tokens, last_tick, arrival)


def test_empty_engine_schedules_nothing():
    assert pick_batch([], EngineConfig()) == []


def test_batch_holds_only_the_compatibility_group_of_the_longest_waiting():
    rs = [fake("img1", "64x64", arrival=1), fake("vid", "video", arrival=0), fake("img2", "64x64", arrival=2)]
    assert [r.state.request_id for r in pick_batch(rs, EngineConfig())] == ["vid"]


def test_max_batch_requests_caps_the_batch():
    rs = [fake(f"r{i}", "k", arrival=i) for i in range(5)]
    assert len(pick_batch(rs, EngineConfig(max_batch_requests=3))) == 3


def test_max_batch_tokens_counts_cfg_rows_but_always_admits_one():
    rs = [fake("a", "k", tokens=100, branches=2, arrival=0), fake("b", "k", tokens=100, branches=2, arrival=1)]
    assert [r.state.request_id for r in pick_batch(rs, EngineConfig(max_batch_tokens=300))] == ["a"]
    assert len(pick_batch(rs[:1], EngineConfig(max_batch_tokens=10))) == 1


def worst_waits(rs, cfg, ticks: int = 60) -> dict[str, int]:
    """Simulate ``ticks`` engine ticks (every request runs forever); each request's longest wait."""
    waits = {r.state.request_id: 0 for r in rs}
    worst = dict(waits)
    for tick in range(1, ticks):
        batch = pick_batch(rs, cfg)
        for r in rs:
            if r in batch:
                r.last_tick = tick
                waits[r.state.request_id] = 0
            else:
                waits[r.state.request_id] += 1
                worst[r.state.request_id] = max(worst[r.state.request_id], waits[r.state.request_id])
    return worst


def bound(rs, b: int) -> int:
    """sum over compatibility groups of ceil(n_g / B), minus 1 (the scheduler's stated bound)."""
    sizes: dict[str, int] = {}
    for r in rs:
        sizes[r.key] = sizes.get(r.key, 0) + 1
    return sum(-(-n // b) for n in sizes.values()) - 1


def test_fairness_bounds_the_wait_of_every_request():
    """A video alone in its group and five images, batches of 2: the bound is 1 + 3 - 1 = 3 ticks, and
    the simulation reaches it (so the bound is tight here, not loose)."""
    cfg = EngineConfig(max_batch_requests=2)
    rs = [fake("video", "v", arrival=0)] + [fake(f"img{i}", "i", arrival=i + 1) for i in range(5)]
    worst = worst_waits(rs, cfg)
    assert bound(rs, 2) == 3 and max(worst.values()) == 3


def test_fairness_bound_holds_on_random_mixes_and_one_group_is_ceil_r_over_b_minus_1():
    import random

    rng = random.Random(7)
    for _ in range(200):
        b = rng.randint(1, 4)
        rs = [fake(f"r{i}", f"g{rng.randint(0, 3)}", arrival=i) for i in range(rng.randint(1, 12))]
        assert max(worst_waits(rs, EngineConfig(max_batch_requests=b)).values()) <= bound(rs, b)
    rs = [fake(f"r{i}", "one", arrival=i) for i in range(7)]
    assert max(worst_waits(rs, EngineConfig(max_batch_requests=3)).values()) == -(-7 // 3) - 1


def test_a_higher_priority_request_takes_the_full_batch_before_lower_ones():
    """Priority orders before waiting time: a request that just joined at priority -1 runs at the
    next tick ahead of lower-priority requests that waited longer; inside a class, longest wait first."""
    rs = [fake(f"low{i}", "k", last_tick=i, arrival=i) for i in range(3)]
    urgent = fake("urgent", "k", last_tick=9, arrival=9)
    urgent.priority = -1
    batch = pick_batch([*rs, urgent], EngineConfig(max_batch_requests=2))
    assert [r.state.request_id for r in batch] == ["urgent", "low0"]


def test_the_group_of_the_highest_priority_request_is_the_batch():
    rs = [fake("img", "64x64", arrival=0), fake("vid", "video", arrival=1)]
    rs[1].priority = -5
    assert [r.state.request_id for r in pick_batch(rs, EngineConfig())] == ["vid"]


def _stream(cfg, low_priority: int, ticks: int) -> tuple[int | None, dict[int, int]]:
    """One request of class ``low_priority`` beside a continuous stream of class-0 requests (a new
    one joins every tick, each runs 3 steps), batches of one: the tick at which the low one first
    runs (None when it never does within ``ticks``), and the requests in the engine at each tick."""
    low = fake("low", "k", last_tick=0, arrival=0)
    low.priority = low_priority
    urgent: list = []
    engine_size = {}
    for tick in range(1, ticks + 1):
        urgent.append(fake(f"u{tick}", "k", last_tick=tick - 1, arrival=tick))
        urgent[-1].steps = 0
        engine_size[tick] = 1 + len(urgent)
        batch = pick_batch([low, *urgent], cfg)
        if batch[0] is low:
            return tick, engine_size
        for r in batch:
            r.last_tick = tick
            r.steps += 1
        urgent = [r for r in urgent if r.steps < 3]
    return None, engine_size


def test_ageing_bounds_the_wait_of_a_request_behind_a_continuous_stream_of_more_urgent_ones():
    """The scheduler's cross-class bound, ``(p - q) * A + R - 1`` ticks, holds while class-0 requests
    keep arriving faster than they run (R grows: every request in the engine at the time counts);
    without ageing (A beyond the run) the class-5 request never runs: the stream would starve it."""
    for age in (1, 4, 10):
        cfg = EngineConfig(max_batch_requests=1, priority_age_ticks=age)
        ran, engine_size = _stream(cfg, 5, ticks=400)
        assert ran is not None
        # waited ran - 1 ticks since its arrival at tick 0, R counted once it has aged (p - q) * A ticks
        assert ran - 1 <= 5 * age + engine_size[5 * age] - 1, (age, ran)
        assert ran - 1 >= 5 * age  # and not before: the stream keeps its precedence for (p - q) * A ticks
    assert _stream(EngineConfig(max_batch_requests=1, priority_age_ticks=10**6), 5, ticks=400)[0] is None


def test_lower_class_places_keeps_less_urgent_requests_out_of_an_urgent_batch():
    rs = [fake(f"low{i}", "k", arrival=i) for i in range(3)]
    urgent = fake("urgent", "k", last_tick=2, arrival=9)
    urgent.priority = -1
    cfg = EngineConfig(max_batch_requests=4, lower_class_places=1)
    assert [r.state.request_id for r in pick_batch([*rs, urgent], cfg)] == ["urgent", "low0"]
    cfg = EngineConfig(max_batch_requests=4, lower_class_places=0)
    assert [r.state.request_id for r in pick_batch([*rs, urgent], cfg)] == ["urgent"]
    assert len(pick_batch([*rs, urgent], EngineConfig(max_batch_requests=4))) == 4


def test_an_aged_leader_runs_even_with_no_places_for_its_class():
    """A less urgent request that has waited past its class's difference leads the batch and runs,
    more urgent requests of its group beside it: ageing wins over ``lower_class_places``."""
    old = fake("old", "k", last_tick=0, arrival=0)
    old.priority = 1
    fresh = fake("fresh", "k", last_tick=20, arrival=1)
    cfg = EngineConfig(max_batch_requests=2, priority_age_ticks=10, lower_class_places=0)
    assert [r.state.request_id for r in pick_batch([fresh, old], cfg)] == ["old", "fresh"]
