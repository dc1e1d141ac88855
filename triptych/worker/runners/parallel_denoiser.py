"""The denoiser of a multi-rank instance (CFG parallel, Ulysses/ring sequence parallel), on rank 0.

It is the single-rank ``DenoiserRunner`` with one difference at each step boundary: rank 0 applies
the aborts and joins, schedules the batch, and broadcasts that decision (``ranks/ticks.Tick``,
then each joining request's conditioning), so every rank runs the identical forward;
the transformer forward is split across the ranks (``triptych.parallel``). Rank 0 alone talks to
the head and the transfer plane. An idle instance still broadcasts an empty tick every
``keepalive_s``, so the followers' collectives never time out while nothing runs.

A failed collective (a rank died, or hung past the collective timeout) or a step that raised (the
ranks may have diverged) fails every request the instance holds as retryable and raises
``InstanceBroken``: the worker exits and its ranks with it, and the head retries the requests
elsewhere. A join a follower cannot add (an adapter it cannot load) fails that request alone
(``ticks.settle_joins``). TeaCache runs on every rank, composed with the ranks (``triptych.parallel.cache``): its skip
decisions are rank 0's, broadcast at each step, so every rank skips the same rows.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from triptych.core.errors import TriptychError
from triptych.engine import EngineConfig
from triptych.parallel import ParallelConfig
from triptych.worker.ranks.instance import InstanceRanks
from triptych.worker.ranks.ticks import InstanceBroken, Join, Tick, instance_engine, lead_tick
from triptych.worker.runners.base import Job
from triptych.worker.runners.denoiser import DenoiserRunner

logger = logging.getLogger(__name__)


class ParallelDenoiserRunner(DenoiserRunner):
    def __init__(
        self,
        family,
        port,
        engine: EngineConfig,
        parallel: ParallelConfig,
        collective_timeout_s: float,
        model_dir: str,
        device: str,
        dtype: str | None = None,
        threads: int = 0,
        profiles_dir: str | Path | None = None,
    ):
        if parallel.cfg > 1 and not engine.fuse_cfg:
            raise ValueError("CFG parallel splits the rows of one fused forward: it needs fuse_cfg=True")
        ranks = InstanceRanks(parallel, collective_timeout_s, threads)
        # A compiled instance warms every rank up here, before the worker registers (ranks/warmup.py).
        groups = ranks.start(family, model_dir, device, dtype, engine, profiles_dir, warm_up=family.speed.compile)
        super().__init__(family, port, instance_engine(family, engine, ranks.parallelism, profiles_dir))
        self.ranks, self.groups = ranks, groups
        self._broken = False  # a collective failed: closing must not wait on another one
        self.keepalive_s = collective_timeout_s / 4
        self._joins: list[tuple[Job, dict[str, torch.Tensor]]] = []
        self._aborts: list[str] = []
        self._last_tick = time.monotonic()

    def has_work(self) -> bool:
        due = time.monotonic() - self._last_tick > self.keepalive_s
        return super().has_work() or bool(self._joins or self._aborts) or due

    def compute(self, job: Job) -> None:
        """An arrival joins at this step boundary, on every rank at once (``execute``)."""
        cond, job.incoming = job.incoming, None
        self._joins.append((job, cond))

    def abort(self, job: Job) -> None:
        if job in self.ready:
            self.ready.remove(job)
        job.incoming = None
        self._joins = [(j, c) for j, c in self._joins if j is not job]
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
            self._ticks.pop(job.request_id, None)
            self._aborts.append(job.request_id)  # leaves every rank's engine at the next boundary

    def execute(self) -> None:
        while self.ready:
            self.run(self.ready.popleft())
        aborted, self._aborts = self._aborts, []
        for rid in aborted:
            self.engine.abort(rid)
        joined, conds = self._join_here()
        batch = [r.state.request_id for r in self.engine.schedule()] if self.engine.has_work() else []
        try:
            out, failed = lead_tick(Tick(aborted, joined, batch), conds, self.engine, self.groups)
        except Exception as e:  # noqa: BLE001 - any failure mid-collective breaks the whole instance
            self._fail_all(e)
            raise InstanceBroken(f"{self.port.instance_id}: the instance's ranks cannot go on ({e})") from None
        self._last_tick = time.monotonic()
        for rid, why in failed.items():  # a follower could not add it (its adapters): it left every rank
            job = self._jobs.pop(rid, None)
            if job is not None and self.port.owns(job):
                self.port.fail(job, TriptychError(f"the request's LoRA failed on {why}"), retryable=False)
        if out is not None:
            self.publish(out)

    def _join_here(self) -> tuple[list[Join], list[dict[str, torch.Tensor]]]:
        """Rank 0's joins: prepared and added here first (so the schedule includes them); only those
        that joined are broadcast (a refusal, e.g. TeaCache on this instance, is the same everywhere)."""
        joined, conds = [], []
        for job, cond in self._joins:
            job.incoming = cond  # where DenoiserRunner.compute reads it
            try:
                super().compute(job)
            except (TriptychError, ValueError) as e:
                self.port.fail(job, e, retryable=False)
                continue
            joined.append(Join(job.request_id, job.task.params))
            conds.append(cond)
        self._joins = []
        return joined, conds

    def _fail_all(self, error: Exception) -> None:
        logger.error("%s: multi-rank instance broken: %s", self.port.instance_id, error)
        self._broken = True
        for job in list(self._jobs.values()) + [j for j, _ in self._joins] + list(self.ready):
            if self.port.owns(job):
                self.port.fail(job, TriptychError(f"the denoiser instance's ranks failed: {error}"), retryable=True)

    def close(self) -> None:
        self.ranks.close(broken=self._broken)
