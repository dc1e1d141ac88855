"""The configuration a ``triptych quality --baseline`` comparison runs, and its gate.

A baseline is always the plain path: each case alone, CFG fused, TeaCache off, in the baseline's
dtype. The configuration under test changes one thing, and its default gate (``--gate auto``) follows:

- this code, no flags: each case alone as the baseline ran it; gate *exact*, max abs 0 (CPU float32
  is bit-reproducible);
- ``--dtype bfloat16`` (any dtype), ``--quantize COMPONENT=MODE``, ``--compile``: the family loaded
  so; gate *exact*, so it fails; ``--gate target`` holds it to the calibration target instead;
- ``--teacache-threshold T|auto``: each case alone through TeaCache; gate *target* (worst PSNR,
  worst SSIM, adherence drop: the profile's calibrated target, else ``Target``'s defaults);
- ``--served N``: every case submitted at once to the serving engine (``DenoiserEngine``: step
  batching, up to N requests per forward, CFG fused); gate *served*, max abs ``SERVED_TOLERANCE``
  (batching changes rounding, not results);
- ``--cfg-parallel 2`` / ``--ulysses N`` / ``--ring N``: each case on a multi-rank instance
  (``run_parallel_request``: this process is rank 0 and spawns the others over gloo); gate
  *parallel*, max abs ``PARALLEL_TOLERANCE``.

``--exact-tolerance`` replaces a max-abs gate's default; ``--gate exact|target`` chooses the gate
whatever the configuration. Combining two changes (e.g. TeaCache and ``--served``) is refused: one
change at a time. Not a configuration here: the transfer backend between stages (it moves bytes
unchanged; its own tests check that), since the in-process engine has no transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from triptych.calibration.batch import Cases, Output, run_cases
from triptych.core.errors import InvalidParam

#: Batched requests differ from alone by rounding (CPU float32, reduction order; docs/exactness.md).
#: Measured max abs on the decoded frames of the default matrices served at batch 4: default model
#: (4 cases, 20 steps) 3.7e-6, tiny FLUX (4 cases) 3.0e-6. The gate allows 10x the larger.
SERVED_TOLERANCE = 3.7e-5
#: Multi-rank against one rank on gloo (reduction order; docs/exactness.md). Measured max abs on the
#: decoded frames of the default matrices: default model CFG-2 3.5e-6; tiny FLUX Ulysses-2 2.4e-6,
#: CFG-2 0 (bit-identical). The gate allows 10x the largest.
PARALLEL_TOLERANCE = 3.5e-5
GATES = ("auto", "exact", "target")


@dataclass(frozen=True)
class Configuration:
    """What runs the baseline's cases (one ``--baseline`` comparison)."""

    teacache_threshold: float = 0.0
    """Resolved TeaCache threshold (0 = off)."""
    teacache_requested: float | str | None = None
    """What was asked for (a number, ``"auto"``, or None)."""
    served_batch: int = 0
    """0: each case alone (``run_cases``); N >= 1: all cases at once through ``DenoiserEngine`` with
    ``max_batch_requests=N``."""
    parallel: object = None
    """A ``ParallelConfig`` with world size > 1, or None (one rank)."""
    gate: str = "auto"
    """``auto`` (by configuration, see the module table), ``exact`` (max abs) or ``target``."""

    def __post_init__(self) -> None:
        if self.served_batch < 0:
            raise InvalidParam("served", self.served_batch, "must be >= 1 (requests per forward), or 0 for off")
        if self.gate not in GATES:
            raise InvalidParam("gate", self.gate, f"must be one of {GATES}")
        if sum(bool(x) for x in (self.teacache_threshold, self.served_batch, self.parallel)) > 1:
            raise InvalidParam(
                "configuration",
                self.describe_flags(),
                "compare one change at a time: TeaCache, --served or parallel degrees",
            )

    def describe_flags(self) -> str:
        return f"teacache {self.teacache_threshold:g}, served {self.served_batch}, parallel {self.parallel}"

    def kind(self) -> str:
        """``exact``, ``served``, ``parallel`` (max abs gates) or ``acceleration`` (target gate)."""
        if self.gate == "target" or (self.gate == "auto" and self.teacache_threshold):
            return "acceleration"
        if self.gate == "exact":
            return "exact"
        return "parallel" if self.parallel is not None else "served" if self.served_batch else "exact"

    def default_tolerance(self) -> float:
        return {"served": SERVED_TOLERANCE, "parallel": PARALLEL_TOLERANCE}.get(self.kind(), 0.0)

    def describe(self, family) -> dict:
        return {
            "teacache_threshold": self.teacache_threshold,
            "teacache_requested": self.teacache_requested,
            "dtype": str(family.dtype),
            "compile": family.speed.compile,
            "quantize": list(family.speed.quantize),
            "device": str(family.device),
            "batch": self.served_batch or 1,
            "served": bool(self.served_batch),
            "parallel": None if self.parallel is None else vars(self.parallel),
            "fuse_cfg": True,
            "gate": self.gate,
        }


def run_configuration(cases: Cases, config: Configuration, cache=None, progress=None) -> tuple[list[Output], float]:
    """The cases' outputs under ``config`` and the denoise CPU seconds of this process."""
    if config.parallel is not None:
        return _run_parallel(cases, config.parallel, progress)
    if config.served_batch:
        return _run_served(cases, config.served_batch, progress)
    return run_cases(cases, config.teacache_threshold, cache, batch_size=1, tag="compare", on_request=progress)


def _run_served(cases: Cases, batch: int, progress) -> tuple[list[Output], float]:
    """All cases at once through the serving engine's step batching (requests join at step boundaries,
    one ``denoise_step`` over the batch per tick)."""
    from triptych.engine import DenoiserEngine, EngineConfig

    family = cases.family
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=batch, fuse_cfg=True))
    states = [family.prepare(f"served-{i}", p, cases.cond(i)) for i, p in enumerate(cases.params)]
    for state in states:
        engine.add(state)
    t0 = time.process_time()
    with torch.no_grad():
        engine.run_until_done()
    seconds = time.process_time() - t0
    outputs = []
    for s in states:
        frames = family.decode(s.latents, s.params).array
        outputs.append(Output(frames, s.latents.detach().clone(), s.total_steps * len(s.branches()), 0))
        if progress is not None:
            progress()
    return outputs, seconds


def _run_parallel(cases: Cases, parallel, progress) -> tuple[list[Output], float]:
    """Each case on a multi-rank instance (this process is rank 0; ``run_parallel_request`` spawns the
    other ranks and closes them after the case). Time is this process's CPU seconds of the whole case."""
    from triptych.worker.ranks.local import run_parallel_request

    family, outputs, seconds = cases.family, [], 0.0
    for i, p in enumerate(cases.params):
        last = {}  # the state after each step: the final latents once done
        t0 = time.process_time()
        frames, _ = run_parallel_request(family, p, parallel, on_step=lambda s: last.update(latents=s.latents))
        seconds += time.process_time() - t0
        rows = p.steps * len(cases.cond(i).branches)
        outputs.append(Output(frames.array, last["latents"].detach().clone(), rows, 0))
        if progress is not None:
            progress()
    return outputs, seconds
