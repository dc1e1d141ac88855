"""The denoiser engine: continuous step batching over requests that each own their state.

Contract: the engine owns every ``DenoiseState`` between ``add`` and the tick that returns it as
finished (or ``abort``). Requests join and leave only at step boundaries; a tick is
schedule() → execute() → update(). ``execute`` is one ``family.denoise_step`` over the batch: one
transformer forward (``fuse_cfg``) or one per CFG branch, never a loop over requests.

Preemption: a request that would have run in a tick but for the more urgent requests in its batch
(it is in the batch the less urgent requests would have made alone) is preempted there; its state and its acceleration's state for it are parked
(``engine.parking``: off the device on CUDA, within ``EngineConfig.max_parked_bytes``; one that
does not fit waits unparked) and resumed at the start of the tick that next runs it. An abort of a
parked request frees its parked memory with the rest of its state. A preempted request steps with
exactly the state it had, so its result is the one it would have had without preemption in the
same batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch

from triptych.core.errors import InvalidParam
from triptych.engine.config import EngineConfig
from triptych.engine.parking import ParkingLot
from triptych.engine.scheduler import Running, displaced, pick_batch
from triptych.engine.stats import LORA_FIELDS, EngineStats
from triptych.families.base import DenoiseState, Family

logger = logging.getLogger(__name__)

#: Why a multi-rank denoiser refuses an adapter with TeaCache (a single rank applies both: docs/lora.md).
LORA_TEACACHE_RULE = (
    "must be 0 with lora on a multi-rank denoiser: TeaCache's piecewise forward with adapters is checked on one "
    "rank only"
)


@dataclass
class EngineStepOutput:
    """What one tick did."""

    finished: list[DenoiseState] = field(default_factory=list)
    progress: list[tuple[str, int, int]] = field(default_factory=list)  # (request_id, step, total)
    batch: list[str] = field(default_factory=list)  # request ids that advanced
    failed: list[tuple[str, Exception]] = field(default_factory=list)  # (request_id, error): left the engine
    #: (request_id, preview index, steps done, total, predicted clean latents) for requests that asked
    #: for a preview at this step (``DenoiseState.preview_steps``; the index is 0-based, in step order,
    #: computed here once for every caller); the tensors are handed over, the engine keeps none
    previews: list[tuple[str, int, int, int, torch.Tensor]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the tick's step (every request of ``batch`` advanced in it)


class DenoiserEngine:
    def __init__(self, family: Family, config: EngineConfig | None = None, accel=None, wrap=None, no_accel: str = ""):
        """``accel``: optional acceleration (e.g. TeaCache) with ``forward(rows, base_forward)``
        and ``release(request_id)``; it owns its per-request state, the engine tells it when a
        request leaves. ``wrap``: optional ``wrap(forward) -> forward`` around the family's rows
        forward (a multi-rank instance's CFG split); ``accel`` calls the wrapped forward for the
        batches it hands on unchanged, and composes with the ranks itself for the rest (TeaCache's
        ``ranks``). ``no_accel``: why there is no ``accel`` (said when a request asks for it)."""
        self.family = family
        self.config = config or EngineConfig()
        self.accel = accel
        self.wrap = wrap
        self.no_accel = no_accel
        self.stats = EngineStats()
        #: counts ``stats.flops`` when set: an object whose ``per_row(rows)`` is the FLOPs of one row of a
        #: transformer forward over ``rows`` (``triptych.plan.costs.RowCosts``). A row TeaCache skips counts
        #: nothing (its embedding, skip test and output head are not counted); a row it computes counts a
        #: whole forward's row.
        self.flop_costs = None
        self._running: dict[str, Running] = {}
        self._parking = ParkingLot(self.config.max_parked_bytes, family.device)
        self._tick = 0
        self._arrivals = count()

    # ---- membership -------------------------------------------------------------------------
    def add(self, state: DenoiseState) -> None:
        """Join at the next step boundary; raises ``InvalidParam`` for an unusable TeaCache request."""
        if state.request_id in self._running:
            raise ValueError(f"request {state.request_id!r} is already running")
        threshold = state.params.teacache_threshold
        lora = state.params.lora
        if lora and threshold > 0 and getattr(self.accel, "ranks", None) is not None:
            raise InvalidParam("teacache_threshold", threshold, LORA_TEACACHE_RULE)
        if lora and self.family.lora is None:
            raise InvalidParam("lora", [n for n, _ in lora], f"this {self.family.name} denoiser serves no adapters")
        if threshold > 0:
            if self.accel is None:
                why = f": {self.no_accel}" if self.no_accel else ""
                raise InvalidParam(
                    "teacache_threshold", threshold, f"TeaCache is not available for {self.family.name}{why}"
                )
            self.accel.admit(state.request_id, threshold, state.total_steps)
        if lora:
            for name, path in state.params.lora_paths:  # run-time adapters: loaded from here on a miss
                self.family.lora.add_path(name, Path(path))
            try:
                self.family.lora.acquire(state.request_id, lora)
            finally:
                self._lora_stats()
        key = self.family.compat_key(state)
        tokens = self.family.row_tokens(state)  # the family knows its latent layout; the engine counts rows
        running = Running(state, key, tokens, self._tick, next(self._arrivals), state.params.priority)
        self._running[state.request_id] = running

    def abort(self, request_id: str) -> bool:
        running = self._running.pop(request_id, None)
        if running is None:
            return False
        self._release(request_id)
        self.stats.aborted += 1
        self._parking_stats()
        return True

    def has_work(self) -> bool:
        return bool(self._running)

    def __len__(self) -> int:
        return len(self._running)

    def request_ids(self) -> list[str]:
        return list(self._running)

    # ---- one tick -----------------------------------------------------------------------------
    def step(self, order: list[str] | None = None) -> EngineStepOutput:
        """One tick. ``order``: the batch another rank scheduled (request ids, in its order) instead of
        scheduling here; every rank of a multi-rank instance runs the leader's batch."""
        batch = self.schedule() if order is None else [self._running[rid] for rid in order]
        out = EngineStepOutput()
        if not batch:
            return out
        if order is None:
            self.preempt(batch)
        self.resume(batch)
        try:
            out.seconds = self.execute(batch)
        except Exception as e:  # noqa: BLE001 - one bad tick must not take the other requests down
            # NOTE: the traceback references the tick's frames and so the batch's tensors (activations
            # of a failed forward); kept in ``out.failed`` it would form a cycle only the cyclic GC
            # frees, much later. The failure is reported by type and message only.
            e.__traceback__ = e.__context__ = e.__cause__ = None
            self.evict(batch, e, out)
            return out
        self.update(batch, out)
        return out

    def schedule(self) -> list[Running]:
        return pick_batch(list(self._running.values()), self.config)

    def preempt(self, batch: list[Running]) -> None:
        """Park the requests more urgent ones displaced from ``batch``: those of the batch the less
        urgent requests would have had alone that are not in it (while the parked memory allows; the
        others wait where they are). A request waiting its turn in its own class is not parked."""
        out = displaced(list(self._running.values()), batch, self.config)
        if not out:
            return
        for r in out:
            if r.parked:
                continue
            if self._parking.park(r.state.request_id, self._parts(r)):
                r.parked = True
                self.stats.preemptions += 1
        self._parking_stats()

    def resume(self, batch: list[Running]) -> None:
        """Bring the parked requests of ``batch`` back onto the device before its step."""
        for r in batch:
            if r.parked:
                self._parking.resume(r.state.request_id, self._parts(r))
                r.parked = False
        self._parking_stats()

    def _parts(self, r: Running) -> list:
        """What parking moves for ``r``: its state, its scheduler and its acceleration's states."""
        extra = self.accel.request_states(r.state.request_id) if self.accel is not None else []
        return [r.state, r.state.scheduler, *extra]

    def _parking_stats(self) -> None:
        self.stats.parked = len(self._parking)
        self.stats.parked_bytes = self._parking.nbytes

    def parked_requests(self) -> list[str]:
        return [rid for rid, r in self._running.items() if r.parked]

    def execute(self, batch: list[Running]) -> float:
        """One step of every request of ``batch``; its wall time in seconds."""
        states = [r.state for r in batch]
        base = self.family.step_forward if self.wrap is None else self.wrap(self.family.step_forward)
        forward = None if self.wrap is None else base
        if self.accel is not None:

            def forward(rows):
                return self.accel.forward(rows, base)

        calls: list = []
        if self.flop_costs is not None:
            counted = forward or self.family.step_forward

            def forward(rows, counted=counted):
                calls.append(rows)
                return counted(rows)

        skipped = self.accel.stats.rows_skipped if self.accel is not None else 0
        t = time.perf_counter()
        step_stats = self.family.denoise_step(states, fuse_cfg=self.config.fuse_cfg, forward=forward)
        elapsed = time.perf_counter() - t
        if calls:
            self._count_flops(calls, (self.accel.stats.rows_skipped - skipped) if self.accel is not None else 0)
        s = self.stats
        s.steps += 1
        s.forwards += step_stats.forwards
        s.rows += step_stats.rows
        s.request_steps += len(states)
        s.count_step(elapsed)
        s.count_batch(len(states))
        if self.accel is not None:
            s.skipped_rows = self.accel.stats.rows_skipped
        self._lora_stats()
        self._graph_stats()
        return elapsed

    def _graph_stats(self) -> None:
        """The step graphs' counters (``Family.step_graphs``), cumulative, into the engine's stats."""
        graphs = self.family.step_graphs
        if graphs is None:
            return
        g, s = graphs.stats, self.stats
        s.graph_replays, s.graph_captures, s.graph_fallbacks = g.replays, g.captures, dict(g.fallbacks)

    def _count_flops(self, calls: list, skipped: int) -> None:
        try:
            per_row = [self.flop_costs.per_row(rows) for rows in calls]
        except Exception:  # noqa: BLE001 - a count that cannot be made must not fail the requests
            logger.warning("FLOP counting is off: the transformer could not be traced on meta", exc_info=True)
            self.flop_costs = None
            return
        self.stats.flops += sum(n * len(rows) for n, rows in zip(per_row, calls)) - skipped * per_row[-1]

    def _lora_stats(self) -> None:
        if self.family.lora is not None:
            for f in LORA_FIELDS:
                setattr(self.stats, f, getattr(self.family.lora.stats, f.removeprefix("lora_")))
            self.stats.lora_resident = self.family.lora.store.loaded()

    def update(self, batch: list[Running], out: EngineStepOutput) -> None:
        self._tick += 1
        for r in batch:
            r.last_tick = self._tick
            rid = r.state.request_id
            out.batch.append(rid)
            out.progress.append((rid, r.state.step, r.state.total_steps))
            if r.state.x0 is not None:
                index = sorted(r.state.preview_steps).index(r.state.step)
                out.previews.append((rid, index, r.state.step, r.state.total_steps, r.state.x0))
                r.state.x0 = None
            if r.state.done:
                del self._running[rid]
                self._release(rid)
                self.stats.finished += 1
                out.finished.append(r.state)

    def evict(self, batch: list[Running], error: Exception, out: EngineStepOutput) -> None:
        """A tick raised: its requests leave the engine (their states may be half-stepped) and are
        reported in ``out.failed``; requests outside the batch keep running untouched."""
        logger.warning("engine step failed for %d request(s): %s: %s", len(batch), type(error).__name__, error)
        for r in batch:
            rid = r.state.request_id
            if self._running.pop(rid, None) is not None:
                self._release(rid)
                self.stats.failed += 1
                out.failed.append((rid, error))

    def _release(self, request_id: str) -> None:
        self._parking.drop(request_id)
        if self.family.lora is not None:
            self.family.lora.release(request_id)
        if self.accel is not None:
            self.accel.release(request_id)

    def run_until_done(
        self,
        on_tick: Callable[[EngineStepOutput], None] | None = None,
        step: Callable[[], EngineStepOutput] | None = None,
    ) -> list[DenoiseState]:
        """The in-process driver (``triptych generate``, calibration, evaluations, tests, benchmarks),
        as nano-vllm's ``generate``: tick until every request finished, the same ``step`` a worker runs.
        ``on_tick(out)`` after each tick (progress, previews, cancellation: what it raises leaves here,
        the caller aborts); ``step``: how a tick runs (default ``self.step``; rank 0 of a multi-rank
        instance broadcasts the tick first). A failed tick raises its error: in process nobody retries."""
        finished: list[DenoiseState] = []
        while self.has_work():
            out = self.step() if step is None else step()
            if out.failed:
                raise out.failed[0][1]
            finished.extend(out.finished)
            if on_tick is not None:
                on_tick(out)
        return finished
