"""Cumulative worker reports → windows of deltas → Prometheus series (no processes, no sockets)."""

from __future__ import annotations

from triptych.chat.stats import ChatEngineStats
from triptych.control import protocol as P
from triptych.control.metrics import Metrics
from triptych.control.worker_stats import stats_window
from triptych.engine.stats import EngineStats
from triptych.mmcache.stats import MMCacheStats
from triptych.transfer.stats import TransferStats

metrics = Metrics()  # this module's own registry


def engine(steps: int, request_steps: int, seconds: float, sizes: dict[int, int], skipped: int = 0) -> EngineStats:
    """``steps`` ticks of ``seconds`` in all, as an engine counts them (each in its time bucket)."""
    stats = EngineStats(forwards=steps, rows=steps, request_steps=request_steps, skipped_rows=skipped)
    for _ in range(steps):
        stats.count_step(seconds / steps)
    stats.steps, stats.batch_sizes = steps, sizes
    return stats


def transfer(pushes: int, nbytes: int, seconds: float) -> TransferStats:
    """``pushes`` pushes of ``nbytes`` and ``seconds`` in all, as a sender counts them."""
    stats = TransferStats(backend="zmq")
    for _ in range(pushes):
        stats.count_push(nbytes // pushes, seconds / pushes)
    return stats


def sample(name: str, labels: str = "") -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_first_report_is_the_whole_window_without_a_rate():
    cur = P.StatsReport(
        instance_id="den-x", uptime_s=30.0, engine=engine(4, 6, 0.4, {1: 2, 2: 2}), transfer=transfer(2, 100, 0.01)
    )
    w = stats_window("denoiser", None, cur)
    assert w.seconds == 0.0 and w.engine == cur.engine and w.transfer == cur.transfer


def test_window_is_the_difference_of_consecutive_reports():
    prev = P.StatsReport(
        instance_id="den-x", uptime_s=10.0, engine=engine(4, 6, 0.4, {1: 2, 2: 2}), transfer=transfer(2, 100, 0.01)
    )
    cur = P.StatsReport(
        instance_id="den-x",
        uptime_s=12.0,
        engine=engine(7, 14, 0.7, {1: 2, 2: 3, 3: 2}, skipped=3),
        transfer=transfer(5, 400, 0.04),
    )
    w = stats_window("denoiser", prev, cur)
    assert w.seconds == 2.0
    assert w.engine.steps == 3 and w.engine.request_steps == 8 and w.engine.skipped_rows == 3
    assert w.engine.batch_sizes == {2: 1, 3: 2}  # unchanged sizes drop out
    assert w.transfer.pushes_sent == 3 and w.transfer.bytes_sent == 300 and w.transfer.backend == "zmq"


def test_a_restarted_worker_counts_from_zero():
    prev = P.StatsReport(
        instance_id="den-x", uptime_s=100.0, engine=engine(50, 50, 5.0, {1: 50}), transfer=transfer(9, 900, 0.1)
    )
    cur = P.StatsReport(
        instance_id="den-x", uptime_s=3.0, engine=engine(2, 2, 0.2, {1: 2}), transfer=transfer(1, 10, 0.01)
    )
    w = stats_window("denoiser", prev, cur)
    assert w.engine == cur.engine and w.transfer == cur.transfer and w.seconds == 3.0


def test_windows_feed_the_denoiser_and_transfer_series():
    before = {
        "b3": sample("triptych_denoiser_batch_size_bucket", '{le="3.0"}'),
        "b2": sample("triptych_denoiser_batch_size_bucket", '{le="2.0"}'),
        "steps": sample("triptych_denoiser_steps_total"),
        "skipped": sample("triptych_denoiser_skipped_steps_total"),
        "ticks": sample("triptych_denoiser_step_seconds_count"),
        "bytes": sample("triptych_transfer_bytes_total", '{backend="zmq"}'),
        "pushes": sample("triptych_transfer_latency_seconds_count", '{backend="zmq"}'),
    }
    prev = P.StatsReport(
        instance_id="den-m", uptime_s=10.0, engine=engine(4, 6, 0.4, {1: 2, 2: 2}), transfer=transfer(2, 100, 0.01)
    )
    cur = P.StatsReport(
        instance_id="den-m",
        uptime_s=12.0,
        engine=engine(7, 14, 0.7, {1: 2, 2: 3, 3: 2}, skipped=3),
        transfer=transfer(5, 400, 0.04),
    )
    metrics.record_worker_window(stats_window("denoiser", prev, cur))
    assert sample("triptych_denoiser_batch_size_bucket", '{le="3.0"}') - before["b3"] == 3  # one 2, two 3s
    assert sample("triptych_denoiser_batch_size_bucket", '{le="2.0"}') - before["b2"] == 1
    assert sample("triptych_denoiser_steps_total") - before["steps"] == 8
    assert sample("triptych_denoiser_skipped_steps_total") - before["skipped"] == 3
    assert sample("triptych_denoiser_step_seconds_count") - before["ticks"] == 3
    assert sample("triptych_denoiser_steps_per_second", '{instance="den-m"}') == 4.0  # 8 steps in 2 s
    assert sample("triptych_transfer_bytes_total", '{backend="zmq"}') - before["bytes"] == 300
    assert sample("triptych_transfer_latency_seconds_count", '{backend="zmq"}') - before["pushes"] == 3
    metrics.forget_instance("den-m")
    assert 'instance="den-m"' not in metrics.render().decode()


def test_step_graph_windows_feed_the_replay_and_eager_series_by_reason():
    replay = ("triptych_denoiser_graph_forwards_total", '{path="replay",reason=""}')
    lora = ("triptych_denoiser_graph_forwards_total", '{path="eager",reason="a LoRA row"}')
    before = {k: sample(*v) for k, v in {"replay": replay, "lora": lora}.items()}
    captures = sample("triptych_denoiser_graph_captures_total")
    prev = EngineStats(graph_replays=5, graph_captures=2, graph_fallbacks={"a LoRA row": 1, "above": 2})
    cur = EngineStats(graph_replays=12, graph_captures=3, graph_fallbacks={"a LoRA row": 4, "above": 2})
    window = cur.since(prev)
    assert window.graph_fallbacks == {"a LoRA row": 3}  # unchanged reasons drop out
    metrics.record_worker_window(
        stats_window(
            "denoiser",
            P.StatsReport(instance_id="den-g", uptime_s=1.0, engine=prev, transfer=transfer(1, 1, 0.1)),
            P.StatsReport(instance_id="den-g", uptime_s=2.0, engine=cur, transfer=transfer(1, 1, 0.1)),
        )
    )
    assert sample(*replay) - before["replay"] == 7 and sample(*lora) - before["lora"] == 3
    assert sample("triptych_denoiser_graph_captures_total") - captures == 1
    metrics.forget_instance("den-g")


def test_refused_transfers_are_counted_by_reason():
    def refused(unauthenticated: int, replays: int, other: int) -> TransferStats:
        stats = TransferStats(backend="zmq")
        stats.add(rejected_pushes=unauthenticated + replays + other, unauthenticated=unauthenticated)
        stats.add(replays_refused=replays)
        return stats

    reasons = ("unauthenticated", "replay", "other")
    before = {r: sample("triptych_transfer_refused_total", f'{{reason="{r}"}}') for r in reasons}
    prev = P.StatsReport(instance_id="den-r", uptime_s=1.0, engine=None, transfer=refused(2, 1, 0))
    cur = P.StatsReport(instance_id="den-r", uptime_s=2.0, engine=None, transfer=refused(7, 4, 2))
    metrics.record_worker_window(stats_window("denoiser", prev, cur))
    after = {r: sample("triptych_transfer_refused_total", f'{{reason="{r}"}}') - before[r] for r in reasons}
    assert after == {"unauthenticated": 5, "replay": 3, "other": 2}
    metrics.forget_instance("den-r")


def test_mm_cache_counters_become_deltas_and_its_size_a_gauge():
    before = {r: sample("triptych_mm_cache_lookups_total", f'{{result="{r}"}}') for r in ("hits", "misses")}
    prev = P.StatsReport(
        instance_id="enc-m",
        uptime_s=10.0,
        engine=None,
        transfer=transfer(0, 0, 0.0),
        mm_cache=MMCacheStats(hits=4, misses=2, bypassed=0, evictions=0, entries=2, nbytes=1000),
    )
    cur = P.StatsReport(
        instance_id="enc-m",
        uptime_s=12.0,
        engine=None,
        transfer=transfer(0, 0, 0.0),
        mm_cache=MMCacheStats(hits=9, misses=3, bypassed=0, evictions=1, entries=2, nbytes=900),
    )
    w = stats_window("encoder", prev, cur)
    assert (w.mm_cache.hits, w.mm_cache.misses, w.mm_cache.evictions) == (5, 1, 1)
    assert (w.mm_cache.entries, w.mm_cache.nbytes) == (2, 900)  # levels: the latest, not a difference
    metrics.record_worker_window(w)
    assert sample("triptych_mm_cache_lookups_total", '{result="hits"}') - before["hits"] == 5
    assert sample("triptych_mm_cache_lookups_total", '{result="misses"}') - before["misses"] == 1
    assert sample("triptych_mm_cache_bytes", '{instance="enc-m"}') == 900
    metrics.forget_instance("enc-m")
    assert 'instance="enc-m"' not in metrics.render().decode()


def test_chat_engine_counters_become_prefill_and_decode_series():
    kinds = ("computed", "reused")
    before = {k: sample("triptych_chat_prefill_tokens_total", f'{{kind="{k}"}}') for k in kinds}
    forwards, tokens = sample("triptych_chat_decode_forwards_total"), sample("triptych_chat_decode_tokens_total")
    prev = P.StatsReport(
        instance_id="enc-c",
        uptime_s=10.0,
        engine=None,
        transfer=transfer(0, 0, 0.0),
        mm_cache=None,
        chat=ChatEngineStats(
            prefill_computed=100,
            prefill_reused=0,
            prefill_forwards=1,
            decode_forwards=10,
            decode_tokens=10,
            prefix_evictions=0,
            prefix_entries=1,
            prefix_nbytes=500,
        ),
    )
    cur = P.StatsReport(
        instance_id="enc-c",
        uptime_s=12.0,
        engine=None,
        transfer=transfer(0, 0, 0.0),
        mm_cache=None,
        chat=ChatEngineStats(
            prefill_computed=160,
            prefill_reused=140,
            prefill_forwards=5,
            decode_forwards=30,
            decode_tokens=90,
            prefix_evictions=1,
            prefix_entries=4,
            prefix_nbytes=2000,
        ),
    )
    w = stats_window("encoder", prev, cur)
    assert (w.chat.prefill_computed, w.chat.prefill_reused, w.chat.decode_tokens) == (60, 140, 80)
    assert (w.chat.prefix_entries, w.chat.prefix_nbytes) == (4, 2000)  # levels: the latest
    metrics.record_worker_window(w)
    assert sample("triptych_chat_prefill_tokens_total", '{kind="computed"}') - before["computed"] == 60
    assert sample("triptych_chat_prefill_tokens_total", '{kind="reused"}') - before["reused"] == 140
    assert sample("triptych_chat_decode_forwards_total") - forwards == 20
    assert sample("triptych_chat_decode_tokens_total") - tokens == 80
    assert sample("triptych_chat_prefix_cache_bytes", '{instance="enc-c"}') == 2000


def test_each_encoder_layer_tier_has_its_series_and_tower_forwards_are_counted():
    """The embedding and processor tiers (and a prefix tier, where the chat engine reports one)
    each become hits/misses/evictions/not_stored deltas and bytes/entries gauges, by tier."""
    from triptych.mmcache.stats import TierStats

    tiers = ("embedding", "processor", "prefix")
    lookups = {
        (t, r): sample("triptych_encoder_cache_lookups_total", f'{{result="{r}",tier="{t}"}}')
        for t in tiers
        for r in ("hits", "misses")
    }
    forwards = sample("triptych_vision_tower_forwards_total")
    prev = MMCacheStats(
        hits=4,
        misses=2,
        bypassed=0,
        evictions=0,
        entries=2,
        nbytes=1000,
        forwards=3,
        processor=TierStats(hits=1, misses=1, evictions=0, not_stored=0, entries=1, nbytes=50),
    )
    cur = MMCacheStats(
        hits=9,
        misses=3,
        bypassed=0,
        evictions=1,
        entries=2,
        nbytes=900,
        not_stored=2,
        forwards=5,
        processor=TierStats(hits=6, misses=2, evictions=1, not_stored=0, entries=2, nbytes=80),
        prefix=TierStats(hits=3, misses=1, evictions=0, not_stored=0, entries=1, nbytes=4096),
    )
    w = stats_window(
        "encoder",
        P.StatsReport(instance_id="enc-t", uptime_s=10.0, engine=None, transfer=transfer(0, 0, 0.0), mm_cache=prev),
        P.StatsReport(instance_id="enc-t", uptime_s=12.0, engine=None, transfer=transfer(0, 0, 0.0), mm_cache=cur),
    )
    metrics.record_worker_window(w)
    got = {
        k: sample("triptych_encoder_cache_lookups_total", f'{{result="{k[1]}",tier="{k[0]}"}}') - v
        for k, v in lookups.items()
    }
    assert got == {
        ("embedding", "hits"): 5,
        ("embedding", "misses"): 1,
        ("processor", "hits"): 5,
        ("processor", "misses"): 1,
        ("prefix", "hits"): 3,
        ("prefix", "misses"): 1,
    }
    assert sample("triptych_vision_tower_forwards_total") - forwards == 2
    assert sample("triptych_encoder_cache_bytes", '{instance="enc-t",tier="processor"}') == 80
    assert sample("triptych_encoder_cache_entries", '{instance="enc-t",tier="embedding"}') == 2
    assert sample("triptych_encoder_cache_evictions_total", '{reason="not_stored",tier="embedding"}') >= 2
    metrics.forget_instance("enc-t")
    assert 'instance="enc-t"' not in metrics.render().decode()


def test_step_and_push_histograms_hold_every_real_observation_not_a_windows_mean():
    """Each tick's and each push's time is counted in its bucket on the worker; the head's histogram
    then equals a prometheus_client Histogram that observed every value itself (buckets, sum, count),
    across two windows. A window's mean (2.4 s here) would have put all three ticks in one bucket."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from triptych.core.buckets import PUSH_SECONDS_BOUNDS, STEP_SECONDS_BOUNDS

    ticks, pushes = [0.003, 0.2, 7.0, 0.05], [0.0004, 0.03, 3.0]
    head = Metrics()
    reference = CollectorRegistry()
    step_ref = Histogram("triptych_denoiser_step_seconds", "x", buckets=STEP_SECONDS_BOUNDS, registry=reference)
    push_ref = Histogram(
        "triptych_transfer_latency_seconds", "x", ["backend"], buckets=PUSH_SECONDS_BOUNDS, registry=reference
    )
    engine_stats, transfer_stats, prev = EngineStats(), TransferStats(backend="zmq"), None
    for window in ((ticks[:3], pushes[:2]), (ticks[3:], pushes[2:])):
        for t in window[0]:
            engine_stats.count_step(t)
            step_ref.observe(t)
        for t in window[1]:
            transfer_stats.count_push(10, t)
            push_ref.labels("zmq").observe(t)
        engine_stats.steps += len(window[0])
        cur = P.StatsReport(
            instance_id="den-h",
            uptime_s=float(len(ticks)),
            engine=engine_stats.copy(),
            transfer=transfer_stats.snapshot(),
        )
        head.record_worker_window(stats_window("denoiser", prev, cur))
        prev = cur

    def series(registry_text: bytes, name: str) -> list[str]:
        return [line for line in registry_text.decode().splitlines() if line.startswith(name + "_")]

    for name in ("triptych_denoiser_step_seconds", "triptych_transfer_latency_seconds"):
        got, want = series(head.render(), name), series(generate_latest(reference), name)
        assert got and got == [line for line in want if "_created" not in line], (got, want)


def test_preemption_series_take_the_window_s_count_and_the_latest_parked_figures():
    def report(uptime: float, preemptions: int, parked: int, nbytes: int) -> P.StatsReport:
        stats = EngineStats(preemptions=preemptions, parked=parked, parked_bytes=nbytes)
        return P.StatsReport(instance_id="den-park", uptime_s=uptime, engine=stats, transfer=transfer(1, 10, 0.01))

    before = sample("triptych_denoiser_preemptions_total")
    first, second = report(1.0, 3, 2, 4096), report(2.0, 5, 0, 0)
    metrics.record_worker_window(stats_window("denoiser", None, first))
    assert sample("triptych_denoiser_parked_bytes", '{instance="den-park"}') == 4096
    assert sample("triptych_denoiser_parked_requests", '{instance="den-park"}') == 2
    window = stats_window("denoiser", first, second)
    assert (window.engine.preemptions, window.engine.parked, window.engine.parked_bytes) == (2, 0, 0)
    metrics.record_worker_window(window)
    assert sample("triptych_denoiser_preemptions_total") - before == 5
    assert sample("triptych_denoiser_parked_bytes", '{instance="den-park"}') == 0
    metrics.forget_instance("den-park")
    assert 'instance="den-park"' not in metrics.render().decode()
