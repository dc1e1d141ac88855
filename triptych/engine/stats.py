"""Engine statistics: one msgspec struct, counted in process and sent to the head as it is.

The engine increments the fields; the worker sends the struct inside ``StatsReport`` (cumulative
since it started); the head turns two consecutive reports into a window with ``since``. Metrics
exporters and log lines read it; nothing here knows Prometheus.
"""

from __future__ import annotations

import msgspec

from triptych.core import buckets


class EngineStats(msgspec.Struct, kw_only=True):
    """A denoiser engine's counters: cumulative since the worker started (or a window's deltas)."""

    steps: int = 0  # engine ticks that ran a forward
    forwards: int = 0  # transformer calls
    rows: int = 0  # rows computed (request × CFG branch)
    request_steps: int = 0  # denoising steps advanced, summed over requests
    skipped_rows: int = 0  # rows served from a cache (TeaCache) instead of the transformer
    flops: float = 0.0  # model FLOPs of the rows the transformer ran (``DenoiserEngine.flop_costs``; 0: not counted)
    step_seconds: float = 0.0  # wall time spent in the engine's execute()
    #: ticks per step-time bucket (``buckets.STEP_SECONDS_BOUNDS``, then +Inf): each tick counted in its own
    step_buckets: list[int] = msgspec.field(default_factory=list)
    batch_sizes: dict[int, int] = msgspec.field(default_factory=dict)  # requests in one tick → such ticks
    finished: int = 0  # requests that finished denoising
    aborted: int = 0  # requests dropped from the engine before finishing
    failed: int = 0  # requests evicted because the engine tick that ran them raised
    preemptions: int = 0  # requests parked because more urgent work took their place (``engine.parking``)
    parked: int = 0  # requests parked now (latest, not a delta)
    parked_bytes: int = 0  # bytes of their parked state now (latest, not a delta)
    lora_loaded: int = 0  # LoRA adapters read into memory
    lora_evicted: int = 0  # LoRA adapters dropped from memory to make room
    lora_hits: int = 0  # requests' adapters found in memory
    lora_misses: int = 0  # requests' adapters that had to be loaded
    lora_mixed_batches: int = 0  # forwards whose rows used different adapter settings (none is one)
    lora_resident: list[str] = msgspec.field(default_factory=list)  # adapters in memory now (latest, not a delta)
    graph_replays: int = 0  # forwards replayed from a step graph (``--step-graphs``)
    graph_captures: int = 0  # step graphs recorded
    graph_fallbacks: dict[str, int] = msgspec.field(default_factory=dict)  # why a forward ran eagerly → forwards

    @property
    def steps_per_second(self) -> float:
        return self.request_steps / self.step_seconds if self.step_seconds else 0.0

    def count_step(self, seconds: float) -> None:
        """One tick's wall time: summed and counted in its bucket."""
        self.step_seconds += seconds
        buckets.observe(self.step_buckets, buckets.STEP_SECONDS_BOUNDS, seconds)

    def count_batch(self, size: int) -> None:
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def copy(self) -> EngineStats:
        return msgspec.structs.replace(
            self,
            batch_sizes=dict(self.batch_sizes),
            step_buckets=list(self.step_buckets),
            lora_resident=list(self.lora_resident),
            graph_fallbacks=dict(self.graph_fallbacks),
        )

    def since(self, prev: EngineStats) -> EngineStats:
        """The window from ``prev`` (an earlier report of the same engine) to this one."""
        sizes = {k: n - prev.batch_sizes.get(k, 0) for k, n in self.batch_sizes.items()}
        return EngineStats(
            steps=self.steps - prev.steps,
            forwards=self.forwards - prev.forwards,
            rows=self.rows - prev.rows,
            request_steps=self.request_steps - prev.request_steps,
            skipped_rows=self.skipped_rows - prev.skipped_rows,
            flops=self.flops - prev.flops,
            step_seconds=self.step_seconds - prev.step_seconds,
            step_buckets=buckets.since(self.step_buckets, prev.step_buckets),
            batch_sizes={k: n for k, n in sizes.items() if n},
            finished=self.finished - prev.finished,
            aborted=self.aborted - prev.aborted,
            failed=self.failed - prev.failed,
            preemptions=self.preemptions - prev.preemptions,
            parked=self.parked,
            parked_bytes=self.parked_bytes,
            **{f: getattr(self, f) - getattr(prev, f) for f in LORA_FIELDS},
            lora_resident=list(self.lora_resident),
            graph_replays=self.graph_replays - prev.graph_replays,
            graph_captures=self.graph_captures - prev.graph_captures,
            graph_fallbacks={
                k: d for k, n in self.graph_fallbacks.items() if (d := n - prev.graph_fallbacks.get(k, 0))
            },
        )


#: The adapter store's counters as they appear here (``LoraStats`` field → ``lora_<field>``).
LORA_FIELDS = ("lora_loaded", "lora_evicted", "lora_hits", "lora_misses", "lora_mixed_batches")
