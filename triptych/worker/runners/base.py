"""What every role runner shares: the job record, the narrow port to its worker, the runner base.

A runner is one role's stage work inside a worker process. It never sees the worker: it gets a
``WorkerPort`` (send a message to the head, reserve slots for an incoming handoff, report a
failure, adopt or finish a job) and answers the worker loop's calls: ``accept(task)`` (a new task
from the head), ``has_work()`` / ``execute()`` (one unit of compute on the loop thread),
``arrived(job, tensors)`` (an incoming handoff landed in our slots; ``preview_arrived`` for a
preview's), ``abort(job)`` (free what the
stage holds for a job the worker dropped), and ``stats()`` / ``load()`` for its reports.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from triptych.control import protocol as P
from triptych.core.errors import TriptychError
from triptych.families.base import GenerationParams
from triptych.transfer import TransferError
from triptych.transfer.refs import TensorSpec

logger = logging.getLogger(__name__)

Task = P.EncodeTask | P.DenoiseTask | P.DecodeTask | P.ChatTask


class RunnerBroken(TriptychError):
    """The runner cannot go on (e.g. a multi-rank instance lost a rank): the worker exits, and its
    instance leaves service; the requests it held were failed as retryable first."""


@dataclass
class Job:
    """One request generation held by this worker."""

    request_id: str
    generation: int
    params: GenerationParams | None  # None for a chat
    task: Task
    reserved: list[str] = field(default_factory=list)  # transfer ids of our slots still waiting for a push
    incoming: dict[str, torch.Tensor] | None = None  # a handoff that landed here, until compute takes it
    outgoing: dict[str, torch.Tensor] | None = None  # produced tensors held until PushTask
    #: denoiser: preview tensors held until their PushTask, by handoff name (``PREVIEW_HANDOFFS``)
    previews: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    received: float = field(default_factory=time.perf_counter)  # when this worker took it


class WorkerPort(Protocol):
    """All a runner may ask of its worker."""

    instance_id: str

    def send(self, msg: P.Message) -> None:
        """Send one control message to the head."""

    def adopt(self, job: Job) -> None:
        """Hold ``job`` (an older generation of the same request is dropped first)."""

    def owns(self, job: Job) -> bool:
        """True while ``job`` is still held (not cancelled, superseded or finished)."""

    def finish(self, job: Job) -> None:
        """The job's work here is over (its result went to the head); stop holding it."""

    def reserve(self, job: Job, handoff: str, specs: dict[str, TensorSpec], source: str, timeout_s: float) -> None:
        """Reserve receiver slots for a handoff and tell the head; ``arrived`` follows (or a failure)."""

    def fail(self, job: Job, error: Exception, retryable: bool) -> None:
        """Drop ``job`` and report ``error`` to the head as a ``StageError``."""

    def stopping(self) -> bool:
        """The worker is shutting down: long work (a chat answer) ends early."""


def owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that own their storage (no views into batch buffers)."""
    return {k: t.detach().contiguous().clone() for k, t in tensors.items()}


def specs_of(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {k: TensorSpec.of(t) for k, t in tensors.items()}


class StageRunner:
    """A queue of ready jobs, computed one per ``execute()`` by priority class (lower first, as the
    head queues them), in arrival order inside a class (``enqueue``)."""

    stage: str
    tasks: tuple[type, ...] = ()

    def __init__(self, family, port: WorkerPort):
        self.family = family
        self.port = port
        self.ready: deque[Job] = deque()
        #: the role's ``triptych.plan.meter.FlopMeter`` and what prices one unit of its work
        #: (``triptych.plan.costs``), both set by ``make_runner``; None: no FLOP counting
        self.meter = None
        self.costs = None

    def accept(self, task: Task) -> None:
        if not isinstance(task, self.tasks):
            raise P.ProtocolError(f"the {self.stage} stage does not take {type(task).__name__}")
        self.take(task)

    def take(self, task: Task) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        return bool(self.ready)

    def execute(self) -> None:
        self.run(self.ready.popleft())

    def run(self, job: Job) -> None:
        try:
            self.compute(job)
        except (TriptychError, RuntimeError, ValueError) as e:
            self.port.fail(job, e, retryable=False)

    def compute(self, job: Job) -> None:
        raise NotImplementedError

    def enqueue(self, job: Job) -> None:
        """Into ``ready`` behind every job of its class and of the classes before it (a chat: class 0)."""
        p = _priority(job)
        at = next((i for i, j in enumerate(self.ready) if _priority(j) > p), len(self.ready))
        self.ready.insert(at, job)

    def arrived(self, job: Job, tensors: dict[str, torch.Tensor]) -> None:
        job.incoming = tensors  # consumed by compute
        self.enqueue(job)

    def preview_arrived(self, job: Job, handoff: str, tensors: dict[str, torch.Tensor]) -> None:
        """A preview's latents landed (decoder); other stages take none."""

    def abort(self, job: Job) -> None:
        if job in self.ready:
            self.ready.remove(job)
        job.incoming = job.outgoing = None
        job.previews.clear()

    def close(self) -> None:
        """The worker is closing: stop anything that runs beside the loop."""

    # ---- reports --------------------------------------------------------------------------------
    def engine_running(self) -> int:
        return 0

    def engine_stats(self):
        return None

    def cache_stats(self):
        return None

    def compute_stats(self):
        """The meter's ``ComputeStats`` (cumulative), or None without a meter."""
        return self.meter.snapshot() if self.meter is not None else None

    def count_flops(self, work) -> None:
        """Add what ``work`` (an encoded ``Conditioning``, a decode's params) cost to the meter; a count
        that cannot be made turns counting off (logged) and never fails the request."""
        if self.meter is None or self.costs is None:
            return
        try:
            self.meter.add(self.costs.cost(work))
        except Exception:  # noqa: BLE001 - metering must not fail a request
            logger.warning("FLOP counting is off: %s could not be traced on meta", self.stage, exc_info=True)
            self.costs = None

    def chat_stats(self):
        return None

    # ---- helpers --------------------------------------------------------------------------------
    def new_job(self, task: Task, params: GenerationParams | None) -> Job:
        job = Job(task.request_id, task.generation, params, task)
        self.port.adopt(job)
        return job

    def receive(self, job: Job, handoff: str, task: P.DenoiseTask | P.DecodeTask) -> None:
        try:
            self.port.reserve(job, handoff, task.specs, task.source, task.reserve_timeout_s)
        except TransferError as e:
            self.port.fail(job, e, retryable=True)


def _priority(job: Job) -> int:
    return job.params.priority if job.params is not None else 0
