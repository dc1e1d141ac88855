"""Prometheus exposition of the stats objects the core produces.

The core (head, orchestrator, workers) never touches Prometheus: it produces plain stats objects
(``StageStats``, ``TransferStats``, worker ``StatsWindow``s, request outcomes, ``describe()``) and
hands them to the ``record_*`` / ``update_*`` functions here, the only writers of the collectors.
All collectors live in one module-level ``REGISTRY`` so any component in the head process can feed
them; ``/metrics`` serves ``render()``.

``describe()`` dict read by ``update_from_describe`` (keys optional)::

    {"instances": [{"id": "enc-0", "role": "encoder", "state": "ready"}, ...],
     "queues": {"encode": 3, "denoise": 1, "decode": 0}}

An instance without ``state`` counts as ``busy`` when its ``assigned`` is non-empty/non-zero, else
``idle``. The orchestrator's describe() gives ``state`` (``busy`` while it holds a slot charged to a
request, else ``idle``); its ``assigned`` counts requests ever routed there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from triptych.server.worker_stats import StatsWindow

REGISTRY = CollectorRegistry(auto_describe=True)
CONTENT_TYPE = CONTENT_TYPE_LATEST

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

QUEUE_DEPTH = Gauge(
    "triptych_queue_depth",
    "Requests waiting per stage (head = admitted, unfinished jobs)",
    ["stage"],
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "triptych_queue_wait_seconds",
    "Time a job waited before a stage started it",
    ["stage"],
    buckets=_SECONDS_BUCKETS,
    registry=REGISTRY,
)
RUN_TIME = Histogram(
    "triptych_stage_run_seconds",
    "Time a stage spent running one job",
    ["stage"],
    buckets=_SECONDS_BUCKETS,
    registry=REGISTRY,
)
TRANSFER_BYTES = Counter(
    "triptych_transfer_bytes", "Tensor bytes moved between instances", ["backend"], registry=REGISTRY
)
TRANSFER_LATENCY = Histogram(
    "triptych_transfer_latency_seconds",
    "Latency of one tensor transfer",
    ["backend"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)
REQUESTS = Counter(
    "triptych_requests", "Finished API requests by endpoint and outcome", ["endpoint", "outcome"], registry=REGISTRY
)
REQUEST_LATENCY = Histogram(
    "triptych_request_latency_seconds",
    "End-to-end time of a generation job at the head",
    ["endpoint"],
    buckets=_SECONDS_BUCKETS,
    registry=REGISTRY,
)
MM_CACHE_LOOKUPS = Counter(
    "triptych_mm_cache_lookups",
    "Vision-encoder calls seen by the encoders' mm-hash caches, by result",
    ["result"],
    registry=REGISTRY,
)
MM_CACHE_BYTES = Gauge(
    "triptych_mm_cache_bytes",
    "Bytes of stored vision-encoder outputs in an encoder's mm-hash cache",
    ["instance"],
    registry=REGISTRY,
)
CHAT_TOKENS = Counter(
    "triptych_chat_tokens",
    "Tokens of answered chats: prompt (images included) and completion",
    ["kind"],
    registry=REGISTRY,
)
VIDEO_JOBS = Counter(
    "triptych_video_jobs",
    "Finished video jobs by outcome (POST /v1/videos counts the accepted request)",
    ["outcome"],
    registry=REGISTRY,
)
VIDEO_JOB_LATENCY = Histogram(
    "triptych_video_job_seconds",
    "Submit-to-completed time of a successful video job",
    buckets=_SECONDS_BUCKETS,
    registry=REGISTRY,
)
INSTANCES = Gauge("triptych_instances", "Worker instances by role and state", ["role", "state"], registry=REGISTRY)
DENOISER_BATCH_SIZE = Histogram(
    "triptych_denoiser_batch_size",
    "Requests advanced by one denoiser engine step (one batched forward)",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
    registry=REGISTRY,
)
DENOISER_STEP_TIME = Summary(
    "triptych_denoiser_step_seconds",
    "Wall time of one denoiser engine step (all requests of its batch)",
    registry=REGISTRY,
)
DENOISER_STEPS = Counter("triptych_denoiser_steps", "Denoising steps advanced, summed over requests", registry=REGISTRY)
DENOISER_SKIPPED = Counter(
    "triptych_denoiser_skipped_steps",
    "Denoising rows (request x CFG branch, one step) served from a cache (TeaCache) instead of the transformer",
    registry=REGISTRY,
)
DENOISER_FORWARDS = Counter("triptych_denoiser_forwards", "Transformer forward calls", registry=REGISTRY)
DENOISER_EVICTED = Counter(
    "triptych_denoiser_evicted_requests",
    "Requests evicted from a denoiser engine because the step that ran them raised (retried elsewhere)",
    registry=REGISTRY,
)
DENOISER_STEP_RATE = Gauge(
    "triptych_denoiser_steps_per_second",
    "Request steps per wall second over a denoiser's last report window",
    ["instance"],
    registry=REGISTRY,
)

#: Outcomes ``record_request`` accepts (a closed set keeps label cardinality bounded).
OUTCOMES = ("success", "invalid", "overloaded", "cancelled", "failed", "error")


@dataclass(frozen=True)
class StageStats:
    """One job's pass through one stage."""

    stage: str  # encode | denoise | decode | ...
    queue_wait_s: float  # enqueued → started
    run_s: float  # started → finished


@dataclass(frozen=True)
class TransferStats:
    """One tensor transfer between instances."""

    backend: str  # zmq | mooncake | local
    nbytes: int
    seconds: float


def record_stage(stats: StageStats) -> None:
    QUEUE_WAIT.labels(stats.stage).observe(stats.queue_wait_s)
    RUN_TIME.labels(stats.stage).observe(stats.run_s)


def record_transfer(stats: TransferStats) -> None:
    TRANSFER_BYTES.labels(stats.backend).inc(stats.nbytes)
    TRANSFER_LATENCY.labels(stats.backend).observe(stats.seconds)


def record_worker_window(window: StatsWindow) -> None:
    """One worker report window (``worker_stats.stats_window``): engine and transfer deltas.

    Reports carry counts and sums, not single events, so the step-time summary and the transfer
    latency histogram observe the window's mean once per event: their ``_count`` and ``_sum`` are
    exact, the latency buckets are smoothed over one report window (a heartbeat interval).
    """
    t = window.transfer
    if t.pushes_sent > 0:
        TRANSFER_BYTES.labels(t.backend).inc(t.bytes_sent)
        _observe_mean(TRANSFER_LATENCY.labels(t.backend), t.push_seconds, t.pushes_sent)
    c = window.mm_cache
    if c is not None:
        for result in ("hits", "misses", "bypassed"):
            MM_CACHE_LOOKUPS.labels(result).inc(getattr(c, result))
        MM_CACHE_BYTES.labels(window.instance_id).set(c.nbytes)
    e = window.engine
    if e is None:
        return
    for size, ticks in e.batch_sizes.items():
        for _ in range(ticks):
            DENOISER_BATCH_SIZE.observe(size)
    _observe_mean(DENOISER_STEP_TIME, e.step_seconds, e.steps)
    DENOISER_STEPS.inc(e.request_steps)
    DENOISER_SKIPPED.inc(e.skipped_rows)
    DENOISER_FORWARDS.inc(e.forwards)
    DENOISER_EVICTED.inc(e.failed)
    if window.seconds > 0:
        DENOISER_STEP_RATE.labels(window.instance_id).set(e.request_steps / window.seconds)


def _observe_mean(metric, total: float, count: int) -> None:
    for _ in range(count):
        metric.observe(total / count)


def forget_instance(instance_id: str) -> None:
    """Drop the per-instance series of an instance that left (died or shut down)."""
    for gauge in (DENOISER_STEP_RATE, MM_CACHE_BYTES):
        try:
            gauge.remove(instance_id)
        except KeyError:
            pass


def record_request(endpoint: str, outcome: str, latency_s: float | None = None) -> None:
    """One finished API request; ``latency_s`` (successful generations) feeds the latency histogram."""
    assert outcome in OUTCOMES, f"unknown outcome {outcome!r}"
    REQUESTS.labels(endpoint, outcome).inc()
    if latency_s is not None:
        REQUEST_LATENCY.labels(endpoint).observe(latency_s)


def record_chat(prompt_tokens: int, completion_tokens: int) -> None:
    CHAT_TOKENS.labels("prompt").inc(prompt_tokens)
    CHAT_TOKENS.labels("completion").inc(completion_tokens)


JOB_OUTCOMES = ("completed", "cancelled", "failed", "interrupted")


def record_video_job(outcome: str, seconds: float | None = None) -> None:
    """One video job that ended; ``seconds`` (completed jobs) feeds the latency histogram."""
    assert outcome in JOB_OUTCOMES, f"unknown outcome {outcome!r}"
    VIDEO_JOBS.labels(outcome).inc()
    if seconds is not None:
        VIDEO_JOB_LATENCY.observe(seconds)


def update_from_describe(describe: dict, head_in_flight: int | None = None) -> None:
    """Replace the instance and queue gauges with a fresh ``backend.describe()`` snapshot."""
    counts: dict[tuple[str, str], int] = {}
    for inst in describe.get("instances", ()):
        state = inst.get("state") or ("busy" if inst.get("assigned") else "idle")
        key = (str(inst.get("role", "unknown")), str(state))
        counts[key] = counts.get(key, 0) + 1
    INSTANCES.clear()
    for (role, state), count in counts.items():
        INSTANCES.labels(role, state).set(count)
    QUEUE_DEPTH.clear()
    for stage, depth in describe.get("queues", {}).items():
        QUEUE_DEPTH.labels(str(stage)).set(depth)
    if head_in_flight is not None:
        QUEUE_DEPTH.labels("head").set(head_in_flight)


def render() -> bytes:
    return generate_latest(REGISTRY)
