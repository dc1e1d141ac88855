"""The denoiser's stage: receive conditioning, prepare, step the batching engine, hold final latents
for the decoder."""

from __future__ import annotations

import torch

from triptych.pipelines.base import Conditioning
from triptych.pipelines.previews import preview_steps
from triptych.server import protocol as P
from triptych.server import wire
from triptych.server.engine import DenoiserEngine, EngineConfig
from triptych.server.runners.base import Job, StageRunner, specs_of
from triptych.server.transfer.staging import to_host


class DenoiserRunner(StageRunner):
    """Every arrival is prepared at the next step boundary, then the engine advances one tick."""

    stage = "denoise"
    tasks = (P.DenoiseTask,)

    def __init__(self, family, port, engine: EngineConfig, accel=None):
        super().__init__(family, port)
        self.engine = DenoiserEngine(family, engine, accel=accel)
        self._jobs: dict[str, Job] = {}  # request id -> its job, while its state is in the engine

    def take(self, task: P.DenoiseTask) -> None:
        self.receive(self.new_job(task, wire.params_from_wire(task.params)), "cond", task)

    def has_work(self) -> bool:
        return bool(self.ready) or self.engine.has_work()

    def engine_running(self) -> int:
        return len(self.engine)

    def engine_stats(self):
        return self.engine.stats.copy()

    def execute(self) -> None:
        while self.ready:  # prepare every arrival first: they join the batch at this step boundary
            super().execute()
        if self.engine.has_work():
            self.publish(self.engine.step())

    def publish(self, out) -> None:
        """Tell the head what one engine tick did."""
        port = self.port
        for rid, error in out.failed:  # another instance may well succeed (e.g. this one ran out of memory)
            job = self._jobs.pop(rid, None)
            if job is not None and port.owns(job):
                port.fail(job, error, retryable=True)
        for rid, step, total in out.progress:
            job = self._jobs.get(rid)
            if job is not None and _follows(job):
                port.send(P.Progress(rid, job.generation, port.instance_id, step, total))
        for rid, index, step, total, x0 in out.previews:
            job = self._jobs.get(rid)
            if job is None or not port.owns(job):
                continue
            handoff = P.PREVIEW_HANDOFFS[index]
            job.previews[handoff] = to_host({"latents": x0.detach().contiguous()})
            specs = specs_of(job.previews[handoff])
            port.send(P.PreviewReady(rid, job.generation, port.instance_id, index, step, total, specs))
        for state in out.finished:
            job = self._jobs.pop(state.request_id, None)
            if job is None or not port.owns(job):
                continue
            job.outgoing = to_host({"latents": state.latents.detach().contiguous()})
            port.send(P.DenoiseDone(job.request_id, job.generation, port.instance_id, specs_of(job.outgoing)))

    def compute(self, job: Job) -> None:
        cond = Conditioning.from_flat(job.outgoing)
        job.outgoing = None
        with torch.no_grad():
            state = self.family.prepare(job.request_id, job.params, cond)
        self.admit(job, state)

    def admit(self, job: Job, state) -> None:
        """``job``'s prepared state joins the engine at the next step boundary."""
        state.preview_steps = preview_steps(_previews(job), state.total_steps)
        self.engine.add(state)
        self._jobs[job.request_id] = job

    def abort(self, job: Job) -> None:
        super().abort(job)
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
        self.engine.abort(job.request_id)


def _follows(job: Job) -> bool:
    """Whether the head follows ``job``'s steps (a video job's progress, the CLI's bar): a step's
    ``Progress`` is a signed control message through the head, ~20 per image nobody reads otherwise."""
    return isinstance(job.task, P.DenoiseTask) and job.task.progress


def _previews(job: Job) -> int:
    """Partial images the head asked for (a job built in process, without a task, asks for none)."""
    return job.task.previews if isinstance(job.task, P.DenoiseTask) else 0
