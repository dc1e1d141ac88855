"""A worker's FLOP meter: the model FLOPs its role executed, and the peak they are rated against."""

from __future__ import annotations

from triptych.plan.compute_stats import ComputeStats
from triptych.plan.peaks import cpu_peak, lookup


def device_peak(device: str, ranks: int = 1) -> float:
    """FLOP/s at the dense bf16 peak of ``ranks`` devices like ``device`` (a torch device name): the
    table's figure for a known accelerator, this CPU's measured matmul rate on ``cpu``; 0 when neither
    (an accelerator the table lacks)."""
    import torch

    kind = torch.device(device).type
    if kind == "cpu":
        return cpu_peak(memory=0).bf16 * ranks
    if kind == "cuda" and torch.cuda.is_available():
        peak = lookup(torch.cuda.get_device_name(torch.device(device).index or 0))
        return peak.bf16 * ranks if peak is not None else 0.0
    return 0.0


class FlopMeter:
    """``add(flops)`` as the role runs; ``snapshot()`` for its stats report. The peak is measured (or
    looked up) once, at the first snapshot."""

    def __init__(self, model: str, device: str, ranks: int = 1) -> None:
        self.model = model
        self.device = device
        self.ranks = ranks
        self.flops = 0.0
        self._peak: float | None = None

    def add(self, flops: float) -> None:
        self.flops += flops

    def snapshot(self) -> ComputeStats:
        if self._peak is None:
            self._peak = device_peak(self.device, self.ranks)
        return ComputeStats(model=self.model, flops=self.flops, peak_flops=self._peak)
