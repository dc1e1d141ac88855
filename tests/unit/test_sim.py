"""triptych.sim: the head's real scheduling code on a virtual clock, against schedules worked out by
hand from a fixed cost model."""

from __future__ import annotations

import json

import pytest

from triptych.core.kinds import Role
from triptych.deploy.config import AutoscaleConfig
from triptych.engine.config import EngineConfig
from triptych.sim.cluster import ClusterConfig
from triptych.sim.costs import CostModel
from triptych.sim.loop import EventLoop
from triptych.sim.report import summarize
from triptych.sim.run import Arrival, closed_loop, simulate
from triptych.sim.workload import Spec

S64 = (64, 64)


def costs(overhead_s: float = 0.0) -> CostModel:
    """Ticks of 0.1 s alone, 0.15 s for two, 0.2 s for three...; encode 0.05 s, decode 0.02 s."""
    return CostModel({S64: {n: 0.05 + 0.05 * n for n in range(1, 9)}}, 0.05, {S64: 0.02}, 0.01, overhead_s)


def one(**kw) -> ClusterConfig:
    return ClusterConfig(**kw)


def lat(records) -> list[float]:
    return [round(r.latency_s, 6) for r in records]


def test_event_loop_runs_in_time_order_and_ties_in_the_order_scheduled():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append("c"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(1.0, lambda: seen.append("b"))
    loop.run(until=1.5)
    assert seen == ["a", "b"] and loop.now == 1.5
    loop.run()
    assert seen == ["a", "b", "c"] and loop.now == 2.0


def test_cost_model_loads_json_and_prices_unmeasured_occupancies(tmp_path):
    path = tmp_path / "c.json"
    d = {"tick_s": {"64x64": {"1": 0.1, "2": 0.15}}, "encode_s": 0.05, "decode_s": {"64x64": 0.02}, "overhead_s": 0.01}
    path.write_text(json.dumps(d))
    c = CostModel.load(path)
    assert c.tick(S64, 2) == 0.15
    assert c.tick(S64, 4) == pytest.approx(0.3)  # past the largest measured: no more batching gain
    assert c.unloaded_s(S64, 3) == pytest.approx(0.01 + 0.05 + 0.3 + 0.02)
    with pytest.raises(KeyError):
        c.tick((128, 128), 1)


def test_one_request_alone_takes_encode_steps_and_decode():
    records, cluster = simulate(costs(0.01), one(), [Arrival(1.0, Spec("interactive", 64, 3), 5.0)], "slo", 5.0)
    assert [r.status for r in records] == [200]
    assert lat(records) == [round(0.05 + 3 * 0.1 + 0.02 + 0.01, 6)]
    assert cluster.counters.done == 1
    assert all(not i.held for i in cluster.registry.instances.values())  # every slot freed


def test_two_requests_share_a_tick_from_the_step_boundary_after_the_second_arrives():
    # A at 0: encode 0-0.05, tick 0.05-0.15 alone. B at 0.01: waits for the encoder, encodes 0.05-0.10,
    # joins at the 0.15 boundary: tick 0.15-0.30 with A (A done), decode A 0.30-0.32; B alone 0.30-0.40,
    # decode 0.40-0.42.
    arrivals = [Arrival(0.0, Spec("interactive", 64, 2), 5.0), Arrival(0.01, Spec("interactive", 64, 2), 5.0)]
    records, cluster = simulate(costs(), one(), arrivals, "fcfs", 5.0)
    assert lat(records) == [0.32, round(0.42 - 0.01, 6)]
    den = cluster.denoisers()[0]
    assert den.ticks == 3 and den.request_steps == 4


def test_preemption_runs_the_urgent_request_alone_where_fcfs_batches_it():
    # A batch-class request of 20 steps from 0 (encode 0-0.05, ticks of 0.1 from 0.05); an interactive
    # one of 2 steps at 0.5 (encode 0.5-0.55) joins at the 0.65 boundary.
    arrivals = [Arrival(0.0, Spec("batch", 64, 20), 50.0), Arrival(0.5, Spec("interactive", 64, 2), 50.0)]
    slo, c_slo = simulate(costs(), one(engine=EngineConfig(lower_class_places=0)), arrivals, "slo", 10.0)
    fcfs, c_fcfs = simulate(costs(), one(engine=EngineConfig(lower_class_places=0)), arrivals, "fcfs", 10.0)
    # slo: two ticks alone (0.65-0.85), decode to 0.87; the batch request is displaced twice.
    assert lat(slo)[1] == round(0.87 - 0.5, 6)
    assert c_slo.denoisers()[0].preemptions == 2
    # fcfs (one class): two ticks of two requests (0.65-0.95), decode to 0.97; nothing displaced.
    assert lat(fcfs)[1] == round(0.97 - 0.5, 6)
    assert c_fcfs.denoisers()[0].preemptions == 0
    # lower_class_places none: the urgent request takes a place in the batch request's batch instead
    shared, c_shared = simulate(costs(), one(engine=EngineConfig(lower_class_places=None)), arrivals, "slo", 10.0)
    assert lat(shared)[1] == lat(fcfs)[1] and c_shared.denoisers()[0].preemptions == 0


def test_a_deadline_the_estimate_cannot_meet_is_refused_at_once_and_not_in_fcfs():
    arrivals = [Arrival(0.0, Spec("batch", 64, 20), 50.0), Arrival(0.1, Spec("interactive", 64, 20), 0.5)]
    slo, _ = simulate(costs(), one(), arrivals, "slo", 10.0)
    fcfs, _ = simulate(costs(), one(), arrivals, "fcfs", 10.0)
    # alone it would need 20 x 0.1 s of steps: past 0.5 s however the batch request is scheduled
    assert [r.status for r in slo] == [200, 429] and slo[1].latency_s == 0.0
    assert [r.status for r in fcfs] == [200, 200] and not fcfs[1].good


def test_the_autoscaler_adds_denoisers_under_a_load_step_and_drains_them_after():
    scaler = AutoscaleConfig(pools=("denoiser=1:4",), up_queue=2, up_wait_s=1.0, down_idle_s=5.0, interval_s=0.5)
    # four decoders: a request holds its decoder slot while it denoises (the router's backpressure)
    config = ClusterConfig(decoders=4, capacity=4, autoscale=scaler, startup_s=2.0, max_queued_requests=10_000)
    arrivals = [Arrival(0.05 * k, Spec("interactive", 64, 20), 100.0) for k in range(200)]  # 20/s for 10 s
    records, cluster = simulate(costs(), config, arrivals, "fcfs", 120.0)
    samples = [s for s in cluster.autoscaler.samples if s.role == Role.DENOISER]
    assert max(s.instances for s in samples) == 4
    assert samples[-1].instances == 1  # back to the minimum once idle
    kinds = [e for _, _, e, _ in cluster.autoscaler.events]
    assert kinds.count("add") == 3 and kinds.count("stop") == 3
    assert all(r.status == 200 for r in records)  # nothing dropped by scaling in
    assert len(cluster.denoisers()) == 4 and sum(d.request_steps for d in cluster.denoisers()) == 200 * 20


def test_summary_counts_goodput_and_attainment_per_class():
    arrivals = [Arrival(0.0, Spec("interactive", 64, 2), 0.35), Arrival(0.01, Spec("interactive", 64, 2), 0.35)]
    records, _ = simulate(costs(), one(), arrivals, "fcfs", 5.0)
    s = summarize(records, 1.0)
    assert s["good"] == 1 and s["classes"]["interactive"]["attainment"] == 0.5  # 0.32 s in, 0.41 s out


def test_closed_loop_capacity_is_one_request_per_unloaded_latency_per_client_and_scales_with_the_costs():
    specs = [Spec("interactive", 64, 2)] * 100  # 0.05 + 2 x 0.1 + 0.02 = 0.27 s each, alone
    assert closed_loop(costs(), one(), specs, 1, 2.8) == pytest.approx(10 / 2.8)
    assert closed_loop(costs().scaled(2.0), one(), specs, 1, 2.8) == pytest.approx(5 / 2.8)
