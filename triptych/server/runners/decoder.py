"""The decoder's stage: receive final latents, decode, encode media, send the bytes to the head."""

from __future__ import annotations

import torch

from triptych.server import protocol as P
from triptych.server import wire
from triptych.server.media import encode_frames
from triptych.server.runners.base import Job, StageRunner


class DecoderRunner(StageRunner):
    stage = "decode"
    tasks = (P.DecodeTask,)

    def take(self, task: P.DecodeTask) -> None:
        self.receive(self.new_job(task, wire.params_from_wire(task.params)), "latents", task)

    def compute(self, job: Job) -> None:
        latents, job.outgoing = job.outgoing["latents"], None
        task: P.DecodeTask = job.task
        with torch.no_grad():
            frames = self.family.decode(latents, job.params)
        data = encode_frames(frames.to_uint8(), task.output_format, task.fps, task.quality)
        self.port.finish(job)
        self.port.send(P.MediaResult(job.request_id, job.generation, self.port.instance_id, data, task.output_format))
