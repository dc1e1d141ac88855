"""``ComputeStats``: the model FLOPs a worker executed and its devices' peak, sent in its stats reports
(no torch here: the head reads them)."""

from __future__ import annotations

import msgspec


class ComputeStats(msgspec.Struct, kw_only=True):
    """Cumulative since the worker started (``flops``), with what the head needs to rate it."""

    model: str = ""  # the model the worker serves (its directory's name)
    flops: float = 0.0  # model FLOPs executed: rows run, CFG branches included (``triptych.plan.costs``)
    peak_flops: float = 0.0  # FLOP/s at the dense bf16 peak of all the instance's devices (0: unknown)
