"""Batch selection and fairness of the denoiser engine, with 10-line fakes."""

from __future__ import annotations

from types import SimpleNamespace

from triptych.server.engine.config import EngineConfig
from triptych.server.engine.scheduler import Running, pick_batch


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


def test_fairness_bounds_the_wait_of_every_request():
    """Simulate ticks: with R requests and batch size B nobody waits more than ceil(R/B)-1 ticks."""
    cfg = EngineConfig(max_batch_requests=2)
    rs = [fake("video", "v", arrival=0)] + [fake(f"img{i}", "i", arrival=i + 1) for i in range(5)]
    waits = {r.state.request_id: 0 for r in rs}
    worst = {r.state.request_id: 0 for r in rs}
    for tick in range(1, 30):
        batch = pick_batch(rs, cfg)
        for r in rs:
            if r in batch:
                r.last_tick = tick
                waits[r.state.request_id] = 0
            else:
                waits[r.state.request_id] += 1
                worst[r.state.request_id] = max(worst[r.state.request_id], waits[r.state.request_id])
    # 6 requests in two groups: the video runs alone, images two at a time → 4 ticks per round.
    assert max(worst.values()) <= 3
    assert worst["video"] <= 3
