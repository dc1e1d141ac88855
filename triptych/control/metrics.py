"""Prometheus exposition of the stats objects the core produces.

The core (head, orchestrator, workers) never touches Prometheus: it produces plain stats objects
(``StageStats``, worker ``StatsWindow``s, request outcomes, ``describe()``) and
hands them to the ``record_*`` / ``update_*`` functions here, the only writers of the collectors.
One ``Metrics`` object per served model, shared with the HTTP head; ``/metrics`` serves
``render_labelled`` of all: each series carries a ``model`` label (the first label).

``describe()`` dict read by ``update_from_describe`` (keys optional)::

    {"instances": [{"id": "enc-0", "role": "encoder", "state": "ready"}, ...],
     "queues": {"encode": 3, "denoise": 1, "decode": 0},
     "tenants": {"generation": {"key-...": 12}, "chat": {}}}  # requests started per tenant, cumulative

An instance without ``state`` counts as ``busy`` when its ``assigned`` is non-empty/non-zero, else
``idle``. The orchestrator's describe() gives ``state`` (``busy`` while it holds a slot charged to a
request, else ``idle``); its ``assigned`` counts requests ever routed there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from triptych.control.metrics_chat import ChatLatencyMetrics
from triptych.control.metrics_flops import FlopMetrics
from triptych.control.metrics_hist import ReportedHistogram
from triptych.control.metrics_lora import LoraMetrics
from triptych.control.metrics_parking import ParkingMetrics
from triptych.control.metrics_remote import RemoteMetrics
from triptych.control.metrics_tenants import TenantMetrics
from triptych.control.metrics_transfer import TransferRefusals
from triptych.core.buckets import PUSH_SECONDS_BOUNDS, STEP_SECONDS_BOUNDS

if TYPE_CHECKING:
    from triptych.control.worker_stats import StatsWindow

CONTENT_TYPE = CONTENT_TYPE_LATEST

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

#: Outcomes ``record_request`` accepts (a closed set keeps label cardinality bounded).
OUTCOMES = ("success", "invalid", "overloaded", "cancelled", "failed", "unavailable", "timed_out", "error")
#: Outcomes ``record_video_job`` accepts.
JOB_OUTCOMES = ("completed", "cancelled", "failed", "interrupted")


@dataclass(frozen=True)
class StageStats:
    """One job's pass through one stage."""

    stage: str  # encode | denoise | decode | ...
    queue_wait_s: float  # enqueued → started
    run_s: float  # started → finished


class Metrics:
    """The head's Prometheus collectors, in a registry of their own (one per head: tests and several
    heads in one process never share series). The only writer of its collectors."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.queue_depth = Gauge(
            "triptych_queue_depth",
            "Requests waiting per stage (head = admitted, unfinished jobs)",
            ["stage"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "triptych_queue_wait_seconds",
            "Time a job waited before a stage started it",
            ["stage"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.run_time = Histogram(
            "triptych_stage_run_seconds",
            "Time a stage spent running one job",
            ["stage"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "triptych_transfer_bytes", "Tensor bytes moved between instances", ["backend"], registry=r
        )
        self.transfer_latency = ReportedHistogram(
            "triptych_transfer_latency_seconds", "Latency of one tensor transfer", PUSH_SECONDS_BOUNDS, r, ["backend"]
        )
        self.requests = Counter(
            "triptych_requests", "Finished API requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.request_latency = Histogram(
            "triptych_request_latency_seconds",
            "End-to-end time of a generation job at the head",
            ["endpoint"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.mm_cache_lookups = Counter(
            "triptych_mm_cache_lookups",
            "Vision-encoder calls seen by the encoders' mm-hash caches, by result",
            ["result"],
            registry=r,
        )
        self.mm_cache_bytes = Gauge(
            "triptych_mm_cache_bytes",
            "Bytes of stored vision-encoder outputs in an encoder's mm-hash cache",
            ["instance"],
            registry=r,
        )
        self.chat_prefill_tokens = Counter(
            "triptych_chat_prefill_tokens",
            "Prompt tokens of chats at admission: computed by a prefill forward, or reused from the prefix KV cache",
            ["kind"],
            registry=r,
        )
        self.chat_decode_forwards = Counter(
            "triptych_chat_decode_forwards",
            "Batched chat decode forwards (each advances every running chat of an encoder by one token)",
            registry=r,
        )
        self.chat_max_batch = Gauge(
            "triptych_chat_max_batch",
            "The most chats an encoder's chat engine ever decoded in one forward",
            ["instance"],
            registry=r,
        )
        self.chat_decode_tokens = Counter(
            "triptych_chat_decode_tokens",
            "Tokens produced by batched chat decode forwards (divided by the forwards: the mean batch size)",
            registry=r,
        )
        self.chat_prefix_bytes = Gauge(
            "triptych_chat_prefix_cache_bytes",
            "Bytes of prompt KV held in an encoder's chat prefix cache",
            ["instance"],
            registry=r,
        )
        self.encoder_cache_lookups = Counter(
            "triptych_encoder_cache_lookups",
            "Lookups in the encoder layer's cache tiers (processor, embedding, prefix), by tier and result",
            ["tier", "result"],
            registry=r,
        )
        self.encoder_cache_evictions = Counter(
            "triptych_encoder_cache_evictions",
            "Entries evicted from an encoder-layer tier (evicted) or never stored for want of room (not_stored)",
            ["tier", "reason"],
            registry=r,
        )
        self.encoder_cache_bytes = Gauge(
            "triptych_encoder_cache_bytes", "Bytes stored in an encoder-layer tier", ["tier", "instance"], registry=r
        )
        self.encoder_cache_entries = Gauge(
            "triptych_encoder_cache_entries", "Entries in an encoder-layer tier", ["tier", "instance"], registry=r
        )
        self.encoder_remote = RemoteMetrics(r)  # cross-encoder embedding hits
        self.transfer_refused = TransferRefusals(r)  # what the workers' endpoints refused
        self.model_flops = FlopMetrics(r)  # model FLOPs and MFU per role
        self.chat_latency = ChatLatencyMetrics(r)  # a chat's time to first token by stage, and its gaps
        self.vision_forwards = Counter(
            "triptych_vision_tower_forwards",
            "Vision-tower forwards the encoders ran (a batch of many images counts one)",
            registry=r,
        )
        self.chat_tokens = Counter(
            "triptych_chat_tokens",
            "Tokens of answered chats: prompt (images included) and completion",
            ["kind"],
            registry=r,
        )
        self.video_jobs = Counter(
            "triptych_video_jobs",
            "Finished video jobs by outcome (POST /v1/videos counts the accepted request)",
            ["outcome"],
            registry=r,
        )
        self.video_job_latency = Histogram(
            "triptych_video_job_seconds",
            "Submit-to-completed time of a successful video job",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.head_events = Counter(
            "triptych_head_events",
            "Head events by kind: retries, instances_lost, worker_restarts, rejoins_requested, unauthenticated, "
            "replays_refused, stale_session, malformed, dropped_stale, ... (the orchestrator's counters)",
            ["event"],
            registry=r,
        )
        self._events_seen: dict[str, float] = {}
        self.tenants = TenantMetrics(r)
        self.instances = Gauge(
            "triptych_instances", "Worker instances by role and state", ["role", "state"], registry=r
        )
        self.denoiser_batch_size = Histogram(
            "triptych_denoiser_batch_size",
            "Requests advanced by one denoiser engine step (one batched forward)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.denoiser_step_time = ReportedHistogram(
            "triptych_denoiser_step_seconds",
            "Wall time of one denoiser engine step (all requests of its batch)",
            STEP_SECONDS_BOUNDS,
            r,
        )
        self.denoiser_steps = Counter(
            "triptych_denoiser_steps", "Denoising steps advanced, summed over requests", registry=r
        )
        self.denoiser_skipped = Counter(
            "triptych_denoiser_skipped_steps",
            "Denoising rows (request x CFG branch, one step) served from a cache (TeaCache) instead of the transformer",
            registry=r,
        )
        self.denoiser_forwards = Counter("triptych_denoiser_forwards", "Transformer forward calls", registry=r)
        self.denoiser_graph_forwards = Counter(
            "triptych_denoiser_graph_forwards",
            "Transformer forwards under --step-graphs: replayed from a CUDA graph, or eager and why",
            ["path", "reason"],
            registry=r,
        )
        self.denoiser_graph_captures = Counter(
            "triptych_denoiser_graph_captures", "Step graphs recorded (--step-graphs)", registry=r
        )
        self.denoiser_evicted = Counter(
            "triptych_denoiser_evicted_requests",
            "Requests evicted from a denoiser engine because the step that ran them raised (retried elsewhere)",
            registry=r,
        )
        self.denoiser_lora = LoraMetrics(r)
        self.denoiser_parking = ParkingMetrics(r)
        self.denoiser_step_rate = Gauge(
            "triptych_denoiser_steps_per_second",
            "Request steps per wall second over a denoiser's last report window",
            ["instance"],
            registry=r,
        )

    def record_stage(self, stats: StageStats) -> None:
        self.queue_wait.labels(stats.stage).observe(stats.queue_wait_s)
        self.run_time.labels(stats.stage).observe(stats.run_s)

    def record_worker_window(self, window: StatsWindow) -> None:
        """One worker report window (``worker_stats.stats_window``): engine and transfer deltas.

        The step-time and transfer-latency histograms add the window's per-bucket counts (each step
        and push counted in its bucket on the worker, ``metrics_hist``): buckets, sum and count exact.
        """
        if window.compute is not None:
            self.model_flops.record(str(window.role), window.instance_id, window.compute, window.seconds)
        t = window.transfer
        if t.pushes_sent > 0:
            self.transfer_bytes.labels(t.backend).inc(t.bytes_sent)
            self.transfer_latency.add(t.push_buckets, t.push_seconds, [t.backend])
        self.transfer_refused.record(t)
        c = window.mm_cache
        if c is not None:
            for result in ("hits", "misses", "bypassed"):
                self.mm_cache_lookups.labels(result).inc(getattr(c, result))
            self.mm_cache_bytes.labels(window.instance_id).set(c.nbytes)
            self.vision_forwards.inc(c.forwards)
            if c.remote is not None:
                self.encoder_remote.record(c.remote)
            for tier, t in c.tiers().items():
                for result in ("hits", "misses"):
                    self.encoder_cache_lookups.labels(tier, result).inc(getattr(t, result))
                self.encoder_cache_evictions.labels(tier, "evicted").inc(t.evictions)
                self.encoder_cache_evictions.labels(tier, "not_stored").inc(t.not_stored)
                self.encoder_cache_bytes.labels(tier, window.instance_id).set(t.nbytes)
                self.encoder_cache_entries.labels(tier, window.instance_id).set(t.entries)
        chat = window.chat
        if chat is not None:
            self.chat_prefill_tokens.labels("computed").inc(chat.prefill_computed)
            self.chat_prefill_tokens.labels("reused").inc(chat.prefill_reused)
            self.chat_decode_forwards.inc(chat.decode_forwards)
            self.chat_decode_tokens.inc(chat.decode_tokens)
            self.chat_prefix_bytes.labels(window.instance_id).set(chat.prefix_nbytes)
            self.chat_max_batch.labels(window.instance_id).set(chat.max_batch)
        e = window.engine
        if e is None:
            return
        for size, ticks in e.batch_sizes.items():
            for _ in range(ticks):
                self.denoiser_batch_size.observe(size)
        self.denoiser_step_time.add(e.step_buckets, e.step_seconds)
        self.denoiser_steps.inc(e.request_steps)
        self.denoiser_skipped.inc(e.skipped_rows)
        self.denoiser_forwards.inc(e.forwards)
        if e.graph_replays:
            self.denoiser_graph_forwards.labels("replay", "").inc(e.graph_replays)
        for reason, n in e.graph_fallbacks.items():
            self.denoiser_graph_forwards.labels("eager", reason).inc(n)
        self.denoiser_graph_captures.inc(e.graph_captures)
        self.denoiser_evicted.inc(e.failed)
        self.denoiser_lora.record(e)
        self.denoiser_parking.record(window.instance_id, e)
        if window.seconds > 0:
            self.denoiser_step_rate.labels(window.instance_id).set(e.request_steps / window.seconds)

    def forget_instance(self, instance_id: str) -> None:
        """Drop the per-instance series of an instance that left (died or shut down)."""
        self.denoiser_parking.forget(instance_id)
        for gauge in (self.denoiser_step_rate, self.mm_cache_bytes, self.chat_prefix_bytes, self.chat_max_batch):
            try:
                gauge.remove(instance_id)
            except KeyError:
                pass
        for gauge in (self.encoder_cache_bytes, self.encoder_cache_entries):
            for tier in ("embedding", "processor", "prefix", "shared"):
                try:
                    gauge.remove(tier, instance_id)
                except KeyError:
                    pass

    def record_request(self, endpoint: str, outcome: str, latency_s: float | None = None) -> None:
        """One finished API request; ``latency_s`` (successful generations) feeds the latency histogram."""
        assert outcome in OUTCOMES, f"unknown outcome {outcome!r}"
        self.requests.labels(endpoint, outcome).inc()
        if latency_s is not None:
            self.request_latency.labels(endpoint).observe(latency_s)

    def record_chat(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.chat_tokens.labels("prompt").inc(prompt_tokens)
        self.chat_tokens.labels("completion").inc(completion_tokens)

    def record_video_job(self, outcome: str, seconds: float | None = None) -> None:
        """One video job that ended; ``seconds`` (completed jobs) feeds the latency histogram."""
        assert outcome in JOB_OUTCOMES, f"unknown outcome {outcome!r}"
        self.video_jobs.labels(outcome).inc()
        if seconds is not None:
            self.video_job_latency.observe(seconds)

    def update_from_describe(self, describe: dict, head_in_flight: int | None = None) -> None:
        """Replace the instance and queue gauges with a fresh ``backend.describe()`` snapshot."""
        counts: dict[tuple[str, str], int] = {}
        for inst in describe.get("instances", ()):
            state = inst.get("state") or ("busy" if inst.get("assigned") else "idle")
            key = (str(inst.get("role", "unknown")), str(state))
            counts[key] = counts.get(key, 0) + 1
        self.instances.clear()
        for (role, state), count in counts.items():
            self.instances.labels(role, state).set(count)
        self.queue_depth.clear()
        for stage, depth in describe.get("queues", {}).items():
            self.queue_depth.labels(str(stage)).set(depth)
        if head_in_flight is not None:
            self.queue_depth.labels("head").set(head_in_flight)
        events = dict(describe.get("stats", {}))
        if "local_workers" in describe:
            events["worker_restarts"] = describe["local_workers"]["restarts"]
        for event, total in events.items():
            delta = total - self._events_seen.get(event, 0)
            if delta > 0:  # the head's counters only grow; a restart of the head restarts both
                self.head_events.labels(event).inc(delta)
                self._events_seen[event] = total
        self.tenants.record(describe.get("tenants", {}))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopMetrics:
    """The head process's own series, not any model's (no ``model`` label): how late its event loop
    runs. Everything the head serves (requests, heartbeats, stream events) waits while the loop is
    held, so a large lag says work runs on the loop that should not."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.lag = Histogram(
            "triptych_head_event_loop_lag_seconds",
            "How late the head's event loop woke a periodic timer: the time it was held by other work",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.last = Gauge("triptych_head_event_loop_lag_last_seconds", "The latest event loop lag measured", registry=r)
        self.max = Gauge(
            "triptych_head_event_loop_lag_max_seconds", "The largest event loop lag since the head started", registry=r
        )
        self._max = 0.0

    def record_loop_lag(self, lag_s: float) -> None:
        self.lag.observe(lag_s)
        self.last.set(lag_s)
        if lag_s > self._max:
            self._max = lag_s
            self.max.set(lag_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Labelled:
    """A collector that re-exports several ``Metrics`` registries, each sample labelled ``model``;
    ``unrouted`` adds the request outcomes of requests refused before a model was chosen (``model=""``)."""

    def __init__(self, by_model: dict[str, Metrics], unrouted: Metrics | None):
        self.by_model = by_model
        self.unrouted = unrouted

    def collect(self):
        sources = [(model, metrics.registry.collect()) for model, metrics in self.by_model.items()]
        if self.unrouted is not None:
            sources.append(("", (f for f in self.unrouted.registry.collect() if f.name == "triptych_requests")))
        families: dict[str, Metric] = {}
        for model, collected in sources:
            for family in collected:
                out = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                out.samples.extend(s._replace(labels={"model": model, **s.labels}) for s in family.samples)
        return list(families.values())


def render_labelled(by_model: dict[str, Metrics], unrouted: Metrics | None = None) -> bytes:
    """Model id → its ``Metrics``, rendered as one exposition with a ``model`` label on every series;
    ``unrouted``'s request outcomes are the ``model=""`` series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Labelled(by_model, unrouted))
    return generate_latest(registry)
