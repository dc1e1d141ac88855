"""Engine statistics: plain counters the metrics exporters read (no Prometheus here)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0  # engine ticks that ran a forward
    forwards: int = 0  # transformer calls
    rows: int = 0  # rows computed (request × CFG branch)
    request_steps: int = 0  # denoising steps advanced, summed over requests
    skipped_rows: int = 0  # rows served from a cache instead of the transformer
    step_seconds: float = 0.0  # wall time spent in execute()
    batch_sizes: Counter = field(default_factory=Counter)  # requests per tick → count
    finished: int = 0
    aborted: int = 0
    failed: int = 0  # requests evicted because the tick that ran them raised

    @property
    def steps_per_second(self) -> float:
        return self.request_steps / self.step_seconds if self.step_seconds else 0.0
