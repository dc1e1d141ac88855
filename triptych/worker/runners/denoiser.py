"""The denoiser's stage: receive conditioning, prepare, step the batching engine, hold final latents
for the decoder.

A request whose adapters do not fit the LoRA budget beside those of the running requests
(``LoraBudgetError``) waits, prepared, until running requests release theirs, then joins (by
priority class, lower first, then first come, first joined: a later request naming adapters waits
behind those of its class and the classes before it; one naming none never waits).
One that cannot fit even with no adapter in use fails at once, naming the sizes.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from triptych.control import protocol as P
from triptych.control import wire
from triptych.engine import DenoiserEngine
from triptych.engine.previews import preview_steps
from triptych.families.base import Conditioning
from triptych.lora.store import LoraBudgetError
from triptych.transfer.staging import to_host
from triptych.worker.runners.base import Job, StageRunner, specs_of


class DenoiserRunner(StageRunner):
    """Every arrival is prepared at the next step boundary, then the engine advances one tick."""

    stage = "denoise"
    tasks = (P.DenoiseTask,)

    def __init__(self, family, port, engine: DenoiserEngine):
        """``engine``: the batching engine this stage steps (built by ``make_runner``: the family's own,
        or a multi-rank instance's)."""
        super().__init__(family, port)
        self.engine = engine
        self._jobs: dict[str, Job] = {}  # request id -> its job, while its state is in the engine
        self._waiting: deque[tuple[Job, object]] = deque()  # (job, prepared state): no LoRA room yet
        self._joined: dict[str, float] = {}  # request id -> when it joined the engine (``DenoiseDone.engine_s``)
        #: request id -> [ticks, their seconds, requests in them]: its ``DenoiseDone.tick_s`` and ``occupancy``
        self._ticks: dict[str, list[float]] = {}

    def take(self, task: P.DenoiseTask) -> None:
        self.receive(self.new_job(task, wire.params_from_wire(task.params)), "cond", task)

    def has_work(self) -> bool:
        return bool(self.ready) or self.engine.has_work() or bool(self._waiting)

    def engine_running(self) -> int:
        return len(self.engine) + len(self._waiting)

    def engine_stats(self):
        return self.engine.stats.copy()

    def compute_stats(self):
        if self.meter is None:
            return None
        self.meter.flops = self.engine.stats.flops  # the engine counts the rows its forwards ran
        return self.meter.snapshot()

    def execute(self) -> None:
        while self.ready:  # prepare every arrival first: they join the batch at this step boundary
            super().execute()
        if self.engine.has_work():
            self.publish(self.engine.step())
        self._join_waiting()

    def publish(self, out) -> None:
        """Tell the head what one engine tick did."""
        port = self.port
        for rid in out.batch:
            ticks = self._ticks.setdefault(rid, [0, 0.0, 0])
            ticks[0] += 1
            ticks[1] += out.seconds
            ticks[2] += len(out.batch)
        for rid, error in out.failed:  # another instance may well succeed (e.g. this one ran out of memory)
            job = self._jobs.pop(rid, None)
            self._joined.pop(rid, None)
            self._ticks.pop(rid, None)
            if job is not None and port.owns(job):
                port.fail(job, error, retryable=True)
        followed = tuple(
            P.StepProgress(request_id=rid, generation=job.generation, step=step, total=total)
            for rid, step, total in out.progress
            if (job := self._jobs.get(rid)) is not None and _follows(job)
        )
        if followed:  # one message per tick, not one per request
            port.send(P.TickReport(instance_id=port.instance_id, progress=followed))
        for rid, index, step, total, x0 in out.previews:
            job = self._jobs.get(rid)
            if job is None or not port.owns(job):
                continue
            handoff = P.PREVIEW_HANDOFFS[index]
            job.previews[handoff] = to_host({"latents": x0.detach().contiguous()})
            specs = specs_of(job.previews[handoff])
            port.send(
                P.PreviewReady(
                    request_id=rid,
                    generation=job.generation,
                    instance_id=port.instance_id,
                    index=index,
                    step=step,
                    total=total,
                    specs=specs,
                )
            )
        for state in out.finished:
            job = self._jobs.pop(state.request_id, None)
            joined = self._joined.pop(state.request_id, None)
            ticks, seconds, requests = self._ticks.pop(state.request_id, None) or (0, 0.0, 0)
            if job is None or not port.owns(job):
                continue
            job.outgoing = to_host({"latents": state.latents.detach().contiguous()})
            port.send(
                P.DenoiseDone(
                    request_id=job.request_id,
                    generation=job.generation,
                    instance_id=port.instance_id,
                    specs=specs_of(job.outgoing),
                    engine_s=0.0 if joined is None else time.monotonic() - joined,
                    tick_s=seconds / ticks if ticks else 0.0,
                    occupancy=requests / ticks if ticks else 0.0,
                )
            )

    def compute(self, job: Job) -> None:
        cond = Conditioning.from_flat(job.incoming)
        job.incoming = None
        with torch.no_grad():
            state = self.family.prepare(job.request_id, job.params, cond)
        self.admit(job, state)

    def admit(self, job: Job, state) -> None:
        """``job``'s prepared state joins the engine at the next step boundary (or waits for LoRA room)."""
        state.preview_steps = preview_steps(_previews(job), state.total_steps)
        if self._waiting and state.params.lora and self._waiting[0][1].params.priority <= state.params.priority:
            # Behind those already waiting before it, even if its adapters are resident: joining would
            # keep them in use and could starve a waiting request. A request without adapters never waits.
            self._wait(job, state)
            return
        self._join(job, state)

    def _join(self, job: Job, state) -> bool:
        try:
            self.engine.add(state)
        except LoraBudgetError:
            if not self.family.lora.store.in_use():
                raise  # it does not fit even alone: waiting would not help
            self._wait(job, state, front=True)
            return False
        self._jobs[job.request_id] = job
        self._joined[job.request_id] = time.monotonic()
        return True

    def _wait(self, job: Job, state, front: bool = False) -> None:
        """Into the LoRA wait at its place: behind every waiting request of its priority class
        (``front``: before them) and of the classes before it."""
        p = state.params.priority
        at = next(
            (
                i
                for i, (_, s) in enumerate(self._waiting)
                if (s.params.priority >= p if front else s.params.priority > p)
            ),
            len(self._waiting),
        )
        self._waiting.insert(at, (job, state))

    def _join_waiting(self) -> None:
        """After a tick released adapters: the waiting requests that fit now join, in order."""
        while self._waiting:
            job, state = self._waiting.popleft()
            try:
                if not self._join(job, state):  # back at the front of its class: the order holds
                    return
            except (LoraBudgetError, ValueError) as e:
                self.port.fail(job, e, retryable=False)

    def abort(self, job: Job) -> None:
        super().abort(job)
        self._waiting = deque((j, s) for j, s in self._waiting if j is not job)
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
            self._joined.pop(job.request_id, None)
            self._ticks.pop(job.request_id, None)
        self.engine.abort(job.request_id)


def _follows(job: Job) -> bool:
    """Whether the head follows ``job``'s steps (a video job's progress, the CLI's bar): its steps
    go in each tick's ``TickReport``, a signed control message through the head nobody reads otherwise."""
    return isinstance(job.task, P.DenoiseTask) and job.task.progress


def _previews(job: Job) -> int:
    """Partial images the head asked for (a job built in process, without a task, asks for none)."""
    return job.task.previews if isinstance(job.task, P.DenoiseTask) else 0
