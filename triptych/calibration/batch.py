"""Run a list of requests through the stages in one process, several at a time, keeping what the
calibration sweep and the quality baselines measure: images, final latents, forwards computed and
skipped per request, and the denoise time (CPU seconds).

Requests are encoded once (:class:`Cases`) and then run as often as a sweep needs, through the
serving engine (``DenoiserEngine``, up to ``batch_size`` requests a tick, CFG branches fused, the
cache as the engine's acceleration); ``batch_size=1`` is exactly ``run_request`` (a request served
alone). The batch composition is the same for every setting a sweep compares, so the plain run and
the cached runs differ only by the cache's decisions (batching changes
rounding, not results).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from triptych.families.base import Conditioning, Family, GenerationParams


@dataclass
class Output:
    """One request's result."""

    frames: np.ndarray  # Frames.array: (frames, H, W, 3) float32 in [0, 1]
    latents: torch.Tensor  # final latents, before decoding
    computed: int  # transformer rows computed (one per CFG branch and step)
    skipped: int  # rows served from the TeaCache


class Cases:
    """Resolved requests with their conditioning, encoded once. Owns the conditioning tensors; runs
    never modify them (``prepare`` copies what it changes)."""

    def __init__(self, family: Family, requests: Sequence[GenerationParams]):
        self.family = family
        self.params = [family.resolve(p) for p in requests]
        self._conds: list[Conditioning | None] = [None] * len(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def cond(self, i: int) -> Conditioning:
        if self._conds[i] is None:
            self._conds[i] = self.family.encode(self.params[i])
        return self._conds[i]


def run_cases(
    cases: Cases,
    threshold: float = 0.0,
    cache=None,
    batch_size: int = 8,
    tag: str = "run",
    on_request: Callable[[], None] | None = None,
) -> tuple[list[Output], float]:
    """Every case at TeaCache ``threshold`` (0 = plain, the family's own forward); returns the outputs
    in order and the denoise time in CPU seconds of this process (``time.process_time``, all its
    threads). NOTE: CPU time, not wall time: on a shared machine other processes' load changes wall
    time by several times between two settings of one sweep, but not the work a setting does.
    ``cache``: a ``TeaCache`` (needed when threshold > 0)."""
    if threshold and cache is None:
        raise ValueError("run_cases: a TeaCache threshold needs a cache")
    from triptych.engine import DenoiserEngine, EngineConfig

    family, outputs, seconds = cases.family, [], 0.0
    config = EngineConfig(max_batch_requests=batch_size, fuse_cfg=True)
    engine = DenoiserEngine(family, config, accel=cache if threshold else None)
    for start in range(0, len(cases), batch_size):
        states, counts = [], {}
        for i in range(start, min(start + batch_size, len(cases))):
            params = cases.params[i].replace(teacache_threshold=threshold)
            state = family.prepare(f"{tag}-{i}", params, cases.cond(i))
            engine.add(state)  # admitted to the cache by the engine, as served
            states.append(state)
            counts[state.request_id] = [0, 0]

        def count(out) -> None:
            for d in cache.last_decisions if threshold else ():
                counts[d.request_id][0 if d.compute else 1] += 1

        t0 = time.process_time()
        try:
            engine.run_until_done(count)
        finally:
            for s in states:  # a raise mid-batch: the rest leave the engine and the cache
                engine.abort(s.request_id)
        seconds += time.process_time() - t0
        for s in states:
            if not threshold:  # plain: every branch of every step computed
                counts[s.request_id] = [s.total_steps * len(s.branches()), 0]
            frames = family.decode(s.latents, s.params).array
            outputs.append(Output(frames, s.latents.detach().clone(), *counts[s.request_id]))
            if on_request is not None:
                on_request()
    return outputs, seconds
