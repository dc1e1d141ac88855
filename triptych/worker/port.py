"""The worker side of a runner's port: the job table, the transfers off the loop, failures.

``JobPort`` is what a runner holds (``runners.base.WorkerPort``): it owns the table of jobs this
worker holds and the transfer futures running on a small thread pool (pushes to a peer, waits for
a peer's push), so a slow or dead peer never stalls the loop. The worker loop calls ``collect()``
to hand finished transfers on: an arrival to the runner, a finished push to the head.

Ownership: a request's tensors belong to this worker from the moment they are produced (or their
slots are reserved) until they were pushed downstream (``PushDone``), the stage finished, or a
``Cancel`` / ``PeerDown`` / failure freed them; ``drop`` frees the slots and tells the runner
(``abort``) to free what the stage holds.

Wiring: the port builds its runner (``runner(port)``, the last step of its constructor), so each is
whole once built and nothing is assigned from outside; the port reaches the runner only through
``StageCallbacks``. Every transfer it runs is tagged with a typed ``Transfer`` (which request
generation, which handoff, in or out).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from triptych.control import protocol as P
from triptych.core.errors import InvalidParam
from triptych.transfer import TransferError
from triptych.transfer.base import TransferEndpoint
from triptych.transfer.refs import TensorSpec
from triptych.worker.runners.base import Job

logger = logging.getLogger(__name__)


class StageCallbacks(Protocol):
    """What the port tells its runner (``StageRunner`` has them all)."""

    stage: str  # the stage named in this worker's ``StageError``s

    def abort(self, job: Job) -> None:
        """``job`` was dropped: free what the stage holds for it."""

    def arrived(self, job: Job, tensors: dict[str, torch.Tensor]) -> None:
        """A handoff ``job`` waited for landed in our slots."""

    def preview_arrived(self, job: Job, handoff: str, tensors: dict[str, torch.Tensor] | None) -> None:
        """A preview's tensors landed (None: they never will, the transfer failed)."""


class Way(Enum):
    IN = "arrived"  # a peer's push into slots we reserved
    OUT = "pushed"  # our push into a peer's slots


@dataclass(frozen=True)
class Transfer:
    """What one transfer future is for."""

    request_id: str
    generation: int
    handoff: str  # ``cond``, ``latents`` or a preview (``P.PREVIEW_HANDOFFS``)
    way: Way

    @property
    def preview(self) -> bool:
        return self.handoff in P.PREVIEW_HANDOFFS

    @property
    def prefix(self) -> str:
        """The transfer-id prefix of this handoff's slots (``reserve``; ids ``prefix/name``)."""
        return f"{self.request_id}/g{self.generation}/{self.handoff}"


class JobPort:
    def __init__(
        self,
        instance_id: str,
        send: Callable[[P.Message], None],
        endpoint: TransferEndpoint,
        stop: threading.Event,
        runner: Callable[[JobPort], StageCallbacks],
        wake: Callable[[], None] = lambda: None,
    ):
        """``runner(port)`` builds the runner this port serves (it gets the port whole, bar ``runner``).
        ``wake``: called (from a transfer thread) when a transfer ends, so the loop collects it now."""
        self.instance_id = instance_id
        self.wake = wake
        self.send = send
        self.endpoint = endpoint
        self.jobs: dict[str, Job] = {}
        self._stop = stop
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"xfer-{instance_id}")
        self._pending: list[tuple[Future, Transfer]] = []
        self.runner = runner(self)

    # ---- the runner's port --------------------------------------------------------------------
    def adopt(self, job: Job) -> None:
        old = self.jobs.get(job.request_id)
        if old is not None:
            self.drop(old.request_id, old.generation, "superseded by a newer generation")
        self.jobs[job.request_id] = job

    def owns(self, job: Job) -> bool:
        return self.jobs.get(job.request_id) is job

    def finish(self, job: Job) -> None:
        if self.owns(job):
            del self.jobs[job.request_id]
            for transfer_id in job.reserved:  # previews still on their way: nobody will decode them
                self.endpoint.cancel(transfer_id)
            job.reserved = []

    def stopping(self) -> bool:
        return self._stop.is_set()

    def reserve(self, job: Job, handoff: str, specs: dict[str, TensorSpec], source: str, timeout_s: float) -> None:
        """Reserve receiver slots for a handoff, tell the head, and wait for the push off-loop."""
        transfer = Transfer(job.request_id, job.generation, handoff, Way.IN)
        refs = self.endpoint.reserve_bundle(
            transfer.prefix, specs, peer=source, timeout_s=timeout_s, request=job.request_id
        )
        job.reserved += [r.transfer_id for r in refs.values()]
        self.send(
            P.SlotsReserved(
                request_id=job.request_id,
                generation=job.generation,
                instance_id=self.instance_id,
                handoff=handoff,
                refs=refs,
            )
        )
        self._submit(transfer, self.endpoint.wait_bundle, refs)

    def fail(self, job: Job, error: Exception, retryable: bool) -> None:
        logger.warning("%s: %s g%d failed: %s", self.instance_id, job.request_id, job.generation, error)
        self.drop(job.request_id, job.generation, "failed")
        invalid = None
        if isinstance(error, InvalidParam):  # the request broke a rule only this worker could check
            invalid = (error.field, repr(error.value)[:80], error.rule)
        stage = "chat" if isinstance(job.task, P.ChatTask) else self.runner.stage
        kind, message = type(error).__name__, str(error)
        self.send(
            P.StageError(
                request_id=job.request_id,
                generation=job.generation,
                instance_id=self.instance_id,
                stage=stage,
                kind=kind,
                message=message,
                retryable=retryable,
                invalid=invalid,
            )
        )

    # ---- the worker loop's side ---------------------------------------------------------------
    def drop(self, request_id: str, generation: int, reason: str) -> None:
        """Free everything held for this request generation (slots, tensors, stage state)."""
        job = self.jobs.get(request_id)
        if job is None or job.generation > generation:
            return
        del self.jobs[request_id]
        for transfer_id in job.reserved:
            self.endpoint.cancel(transfer_id)
        self.runner.abort(job)
        logger.info("%s dropped %s g%d (%s)", self.instance_id, request_id, generation, reason)

    def drop_all(self, reason: str) -> None:
        for rid, job in list(self.jobs.items()):
            self.drop(rid, job.generation, reason)

    def push(self, msg: P.PushTask) -> None:
        job = self.jobs.get(msg.request_id)
        tensors = None
        if job is not None and job.generation == msg.generation:
            if msg.handoff in P.PREVIEW_HANDOFFS:
                tensors = job.previews.pop(msg.handoff, None)
            else:
                tensors, job.outgoing = job.outgoing, None
        if tensors is None:
            logger.debug("%s: stale PushTask %s g%d", self.instance_id, msg.request_id, msg.generation)
            return
        self._submit(
            Transfer(msg.request_id, msg.generation, msg.handoff, Way.OUT), self.endpoint.push_bundle, msg.refs, tensors
        )

    def collect(self) -> None:
        """Hand finished transfer futures on; results of dropped jobs are discarded."""
        done = [p for p in self._pending if p[0].done()]
        self._pending = [p for p in self._pending if not p[0].done()]
        for future, t in done:
            job = self.jobs.get(t.request_id)
            current = job is not None and job.generation == t.generation
            if current and t.way is Way.IN:
                job.reserved = [r for r in job.reserved if not r.startswith(t.prefix + "/")]
            try:
                result = future.result()
            except TransferError as e:
                if current and t.preview:  # a lost preview costs the client one partial image, no more
                    logger.info(
                        "%s: %s of %s g%d dropped: %s", self.instance_id, t.handoff, t.request_id, t.generation, e
                    )
                    if t.way is Way.IN:
                        self.runner.preview_arrived(job, t.handoff, None)
                elif current:
                    self.fail(job, e, retryable=True)
                continue
            if not current:
                continue
            if t.way is Way.IN and t.preview:
                self.runner.preview_arrived(job, t.handoff, result)
            elif t.way is Way.IN:
                self.runner.arrived(job, result)
            elif not t.preview:  # a pushed preview leaves the job as it was
                del self.jobs[t.request_id]
                self.send(
                    P.PushDone(
                        request_id=t.request_id,
                        generation=t.generation,
                        instance_id=self.instance_id,
                        handoff=t.handoff,
                    )
                )

    def settle(self, timeout_s: float) -> None:
        """Wait for the transfers already running to end (a rejoin), then forget them."""
        futures_wait([f for f, _ in self._pending], timeout=timeout_s)
        self._pending = []

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, transfer: Transfer, fn, *args) -> None:
        future = self._pool.submit(fn, *args)
        future.add_done_callback(lambda _: self.wake())
        self._pending.append((future, transfer))
