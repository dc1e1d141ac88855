"""The simulator's cost model: seconds of one denoiser tick by shape and batch occupancy, of one
encode, of one decode by shape, of one chat, and a fixed per-request overhead (HTTP, transfers,
the head), measured (benchmarks/sim_costs.py writes the JSON ``load`` reads).

A shape is ``(height, width)``; an occupancy above the largest measured costs the largest
measured tick times n / largest (no batching gain assumed past what was measured), one below the
smallest the smallest's; a shape not measured raises ``KeyError``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CostModel:
    tick_s: dict[tuple[int, int], dict[int, float]]  # shape -> occupancy -> seconds of one tick
    encode_s: float
    decode_s: dict[tuple[int, int], float]
    chat_s: float = 0.0
    overhead_s: float = 0.0
    source: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        d = json.loads(Path(path).read_text())

        def shape(key: str) -> tuple[int, int]:
            h, w = key.split("x")
            return int(h), int(w)

        return cls(
            tick_s={shape(k): {int(n): float(s) for n, s in v.items()} for k, v in d["tick_s"].items()},
            encode_s=float(d["encode_s"]),
            decode_s={shape(k): float(v) for k, v in d["decode_s"].items()},
            chat_s=float(d.get("chat_s", 0.0)),
            overhead_s=float(d.get("overhead_s", 0.0)),
            source={k: v for k, v in d.items() if k not in ("tick_s", "decode_s")},
        )

    def scaled(self, factor: float) -> CostModel:
        """Every stage's seconds times ``factor`` (the overhead unchanged): the same work on a
        slower share of a machine."""
        return CostModel(
            {k: {n: s * factor for n, s in v.items()} for k, v in self.tick_s.items()},
            self.encode_s * factor,
            {k: s * factor for k, s in self.decode_s.items()},
            self.chat_s * factor,
            self.overhead_s,
            {**self.source, "scaled": factor},
        )

    def tick(self, shape: tuple[int, int], occupancy: int) -> float:
        table = self.tick_s[shape]
        if occupancy in table:
            return table[occupancy]
        top, low = max(table), min(table)
        if occupancy > top:
            return table[top] * occupancy / top
        return table[low]

    def unloaded_s(self, shape: tuple[int, int], steps: int) -> float:
        """One request alone, arrival to answer: overhead, encode, its steps alone, decode."""
        return self.overhead_s + self.encode_s + steps * self.tick(shape, 1) + self.decode_s[shape]
