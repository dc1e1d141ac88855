"""What each role does with its tasks: the stage half of ``worker.py`` (the process half).

Every runner answers the same five calls from the worker loop: ``accept(task)`` (a new task from
the head), ``has_work()`` / ``execute()`` (one unit of compute on the loop thread), ``arrived(job,
tensors)`` (an incoming handoff landed in our slots), ``abort(job)`` (free what the stage holds).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from triptych.errors import TriptychError
from triptych.pipelines.base import Conditioning, GenerationParams, Role
from triptych.server import protocol as P
from triptych.server.engine import DenoiserEngine
from triptych.server.engine.accel import make_teacache
from triptych.server.transfer import TransferError
from triptych.server.transfer.refs import dtype_name

if TYPE_CHECKING:
    from triptych.server.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One request generation held by this worker."""

    request_id: str
    generation: int
    params: GenerationParams | None  # None for a chat
    task: P.EncodeTask | P.DenoiseTask | P.DecodeTask | P.ChatTask
    reserved: list[str] = field(default_factory=list)  # transfer ids of our slots still waiting for a push
    outgoing: dict[str, torch.Tensor] | None = None  # produced tensors held until PushTask


def specs_of(tensors: dict[str, torch.Tensor]) -> dict[str, P.TensorSpec]:
    return {k: P.TensorSpec(dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items()}


def _owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that own their storage (no views into batch buffers)."""
    return {k: t.detach().contiguous().clone() for k, t in tensors.items()}


class StageRunner:
    stage: str

    def __init__(self, worker: Worker):
        self.worker = worker
        self.family = worker.family
        self.ready: deque[Job] = deque()  # jobs whose compute can run now, in arrival order

    def accept(self, task) -> None:
        raise P.ProtocolError(f"{self.worker.role.value} does not take {type(task).__name__}")

    def has_work(self) -> bool:
        return bool(self.ready)

    def execute(self) -> None:
        self.run(self.ready.popleft())

    def run(self, job: Job) -> None:
        try:
            self.compute(job)
        except (TriptychError, RuntimeError, ValueError) as e:
            self.worker.fail(job, e, retryable=False)

    def compute(self, job: Job) -> None:
        raise NotImplementedError

    def arrived(self, job: Job, tensors: dict[str, torch.Tensor]) -> None:
        job.outgoing = tensors  # consumed by compute
        self.ready.append(job)

    def abort(self, job: Job) -> None:
        if job in self.ready:
            self.ready.remove(job)
        job.outgoing = None

    def engine_running(self) -> int:
        return 0

    def engine_report(self) -> P.EngineReport | None:
        return None

    def _new_job(self, task) -> Job:
        job = Job(task.request_id, task.generation, P.params_from_wire(task.params), task)
        old = self.worker.jobs.get(job.request_id)
        if old is not None:
            self.worker.drop(old.request_id, old.generation, "superseded by a newer generation")
        self.worker.jobs[job.request_id] = job
        return job

    def _receive(self, job: Job, handoff: str, task) -> None:
        try:
            self.worker.reserve(job, handoff, task.specs, task.source, task.reserve_timeout_s)
        except TransferError as e:
            self.worker.fail(job, e, retryable=True)


class EncoderRunner(StageRunner):
    """Encode, hold the conditioning, push it to the denoiser the head names."""

    stage = "encode"

    def accept(self, task) -> None:
        if isinstance(task, P.ChatTask):
            return self._accept_chat(task)
        if not isinstance(task, P.EncodeTask):
            return super().accept(task)
        self.ready.append(self._new_job(task))

    def compute(self, job: Job) -> None:
        if isinstance(job.task, P.ChatTask):
            return self._chat(job)
        with torch.no_grad():
            cond = self.family.encode(job.params)
        job.outgoing = _owned(cond.flat())
        self.worker.send(P.EncodeDone(job.request_id, job.generation, self.worker.instance_id, specs_of(job.outgoing)))

    # ---- chat (the VLM understanding path, on the encoder's own Qwen2.5-VL) -------------------
    def _accept_chat(self, task: P.ChatTask) -> None:
        job = Job(task.request_id, task.generation, None, task)
        old = self.worker.jobs.get(job.request_id)
        if old is not None:
            self.worker.drop(old.request_id, old.generation, "superseded by a newer generation")
        self.worker.jobs[job.request_id] = job
        self.ready.append(job)

    def _chat(self, job: Job) -> None:
        """Generate the answer on the loop thread. Between tokens the worker does what its loop would:
        reads the control socket (a ``Cancel`` stops generation at the next token), runs the encodes
        that arrived (an image request never waits for a long answer; encodes draw no random numbers,
        so a seeded answer is the same), and hands finished transfers on. Each decoded piece goes to
        the head as a ``ChatDelta`` when the client streams."""
        worker, task = self.worker, job.task
        model = self.family.chat_model()
        if model is None:
            raise TriptychError(f"{worker.instance_id} has no VLM to chat with")

        def cancelled() -> bool:
            worker.receive(0)
            for other in [j for j in self.ready if not isinstance(j.task, P.ChatTask)]:
                self.ready.remove(other)
                self.run(other)
            worker.collect()
            return worker.jobs.get(job.request_id) is not job or worker.stopping

        def piece(text: str) -> None:
            worker.send(P.ChatDelta(job.request_id, job.generation, worker.instance_id, text))

        result = model.run(P.chat_from_wire(task), piece if task.stream else None, cancelled)
        if result.finish_reason == "cancelled":
            if worker.jobs.get(job.request_id) is job:  # stopped by a shutdown, not by the head
                worker.fail(job, TriptychError(f"{worker.instance_id} is shutting down"), retryable=True)
            return
        worker.jobs.pop(job.request_id, None)
        worker.send(
            P.ChatDone(
                job.request_id,
                job.generation,
                worker.instance_id,
                result.text,
                result.prompt_tokens,
                result.completion_tokens,
                result.finish_reason,
            )
        )


class DenoiserRunner(StageRunner):
    """Receive conditioning, prepare, step the batching engine, hold final latents for the decoder."""

    stage = "denoise"

    def __init__(self, worker: Worker):
        super().__init__(worker)
        self.engine = DenoiserEngine(self.family, worker.config.engine, accel=make_teacache(self.family))

    def accept(self, task) -> None:
        if not isinstance(task, P.DenoiseTask):
            return super().accept(task)
        self._receive(self._new_job(task), "cond", task)

    def has_work(self) -> bool:
        return bool(self.ready) or self.engine.has_work()

    def engine_running(self) -> int:
        return len(self.engine)

    def engine_report(self) -> P.EngineReport:
        s = self.engine.stats
        counts = {f: getattr(s, f) for f in P.EngineReport.__struct_fields__ if f != "batch_sizes"}
        return P.EngineReport(**counts, batch_sizes=dict(s.batch_sizes))

    def execute(self) -> None:
        while self.ready:  # prepare every arrival first: they join the batch at this step boundary
            super().execute()
        if not self.engine.has_work():
            return
        out = self.engine.step()
        worker = self.worker
        for rid, error in out.failed:  # another instance may well succeed (e.g. this one ran out of memory)
            job = worker.jobs.get(rid)
            if job is not None:
                worker.fail(job, error, retryable=True)
        for rid, step, total in out.progress:
            job = worker.jobs.get(rid)
            if job is not None:
                worker.send(P.Progress(rid, job.generation, worker.instance_id, step, total))
        for state in out.finished:
            job = worker.jobs.get(state.request_id)
            if job is None:
                continue
            job.outgoing = {"latents": state.latents.detach().contiguous()}
            worker.send(P.DenoiseDone(job.request_id, job.generation, worker.instance_id, specs_of(job.outgoing)))

    def compute(self, job: Job) -> None:
        cond = Conditioning.from_flat(job.outgoing)
        job.outgoing = None
        with torch.no_grad():
            state = self.family.prepare(job.request_id, job.params, cond)
        self.engine.add(state)

    def abort(self, job: Job) -> None:
        super().abort(job)
        self.engine.abort(job.request_id)


class DecoderRunner(StageRunner):
    """Receive final latents, decode, encode media, send the bytes to the head."""

    stage = "decode"

    def accept(self, task) -> None:
        if not isinstance(task, P.DecodeTask):
            return super().accept(task)
        self._receive(self._new_job(task), "latents", task)

    def compute(self, job: Job) -> None:
        from triptych.server.media import encode_frames

        latents, job.outgoing = job.outgoing["latents"], None
        task: P.DecodeTask = job.task
        with torch.no_grad():
            frames = self.family.decode(latents, job.params)
        data = encode_frames(frames.to_uint8(), task.output_format, task.fps, task.quality)
        self.worker.jobs.pop(job.request_id, None)
        self.worker.send(
            P.MediaResult(job.request_id, job.generation, self.worker.instance_id, data, task.output_format)
        )


RUNNERS = {Role.ENCODER: EncoderRunner, Role.DENOISER: DenoiserRunner, Role.DECODER: DecoderRunner}


def make_runner(worker: Worker) -> StageRunner:
    return RUNNERS[worker.role](worker)
