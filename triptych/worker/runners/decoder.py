"""The decoder's stage: receive final latents, decode, encode media, send the bytes to the head.

Previews (``PreviewTask``) arrive before the request's ``DecodeTask`` and use the same job: each is
a handoff of its own (``preview0``..), decoded as it lands and answered with ``PreviewResult``. The
final decode waits until every preview asked for before it was decoded or lost, so a client sees
its partial images before its final image. A preview never fails its request: one that cannot be
received or decoded is logged and dropped.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from triptych.control import protocol as P
from triptych.control import wire
from triptych.core.errors import TriptychError
from triptych.core.media import encode_frames
from triptych.transfer import TransferError
from triptych.worker.runners.base import Job, StageRunner

logger = logging.getLogger(__name__)


class DecoderRunner(StageRunner):
    stage = "decode"
    tasks = (P.DecodeTask, P.PreviewTask)

    def __init__(self, family, port):
        super().__init__(family, port)
        self._held: dict[str, Job] = {}  # request id → its job, from its first task to its end
        self._pending: dict[str, dict[str, P.PreviewTask]] = {}  # request id → previews not yet decoded
        self._final_waiting: dict[str, Job] = {}  # final latents here, waiting for earlier previews
        self._previews: deque[tuple[Job, str, dict[str, torch.Tensor]]] = deque()  # landed previews

    def take(self, task: P.DecodeTask | P.PreviewTask) -> None:
        job = self._held.get(task.request_id)
        if job is None or job.generation != task.generation or not self.port.owns(job):
            job = self.new_job(task, wire.params_from_wire(task.params))
            self._held[task.request_id] = job
            self._pending[task.request_id] = {}
        if isinstance(task, P.DecodeTask):
            job.task = task
            self.receive(job, "latents", task)
            return
        handoff = P.PREVIEW_HANDOFFS[task.index]
        try:
            self.port.reserve(job, handoff, task.specs, task.source, task.reserve_timeout_s)
        except TransferError as e:
            logger.info("%s: no slots for %s of %s: %s", self.port.instance_id, handoff, task.request_id, e)
            return
        self._pending[task.request_id][handoff] = task

    def has_work(self) -> bool:
        return bool(self._previews) or bool(self.ready)

    def execute(self) -> None:
        if self._previews:
            self._decode_preview(*self._previews.popleft())
        else:
            super().execute()

    def arrived(self, job: Job, tensors: dict[str, torch.Tensor]) -> None:
        job.incoming = tensors
        if self._pending.get(job.request_id):
            self._final_waiting[job.request_id] = job
        else:
            self.enqueue(job)

    def preview_arrived(self, job: Job, handoff: str, tensors: dict[str, torch.Tensor] | None) -> None:
        if tensors is None:
            self._preview_done(job, handoff)
        else:
            self._previews.append((job, handoff, tensors))

    def _decode_preview(self, job: Job, handoff: str, tensors: dict[str, torch.Tensor]) -> None:
        task = self._pending.get(job.request_id, {}).get(handoff)
        if task is None or not self.port.owns(job):
            return
        try:
            with torch.no_grad():
                frames = self.family.decode(tensors["latents"], job.params)
                self.count_flops(job.params)
            data = encode_frames(frames.to_uint8(), task.output_format, 16, task.quality)
        except (TriptychError, RuntimeError, ValueError) as e:
            logger.warning("%s: %s of %s not decoded: %s", self.port.instance_id, handoff, job.request_id, e)
        else:
            msg = P.PreviewResult(
                request_id=job.request_id, generation=job.generation, instance_id=self.port.instance_id, index=task.index, step=task.step, total=task.total, data=data,
                output_format=task.output_format,
            )  # fmt: skip
            self.port.send(msg)
        self._preview_done(job, handoff)

    def _preview_done(self, job: Job, handoff: str) -> None:
        pending = self._pending.get(job.request_id)
        if pending is None or self._held.get(job.request_id) is not job:
            return
        pending.pop(handoff, None)
        if not pending and job.request_id in self._final_waiting:
            self.enqueue(self._final_waiting.pop(job.request_id))

    def compute(self, job: Job) -> None:
        latents, job.incoming = job.incoming["latents"], None
        task: P.DecodeTask = job.task
        with torch.no_grad():
            frames = self.family.decode(latents, job.params)
        self.count_flops(job.params)
        data = encode_frames(frames.to_uint8(), task.output_format, task.fps, task.quality)
        if len(data) > P.MAX_MEDIA_BYTES:  # the head would drop the frame unread: say why instead
            raise ValueError(
                f"the encoded {task.output_format} is {len(data)} bytes, above the {P.MAX_MEDIA_BYTES} a result "
                "may carry to the head: ask for fewer frames, a smaller size or a lower quality"
            )
        self._forget(job)
        self.port.finish(job)
        self.port.send(
            P.MediaResult(
                request_id=job.request_id,
                generation=job.generation,
                instance_id=self.port.instance_id,
                data=data,
                output_format=task.output_format,
            )
        )

    def abort(self, job: Job) -> None:
        super().abort(job)
        self._previews = deque(p for p in self._previews if p[0] is not job)
        self._forget(job)

    def _forget(self, job: Job) -> None:
        if self._held.get(job.request_id) is job:
            del self._held[job.request_id]
            self._pending.pop(job.request_id, None)
            self._final_waiting.pop(job.request_id, None)
