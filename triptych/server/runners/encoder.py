"""The encoder's stage: encode, hold the conditioning, push it to the denoiser the head names; and
answer chats on the encoder's own VLM (the text encoder of Qwen-Image families is a Qwen2.5-VL)."""

from __future__ import annotations

import torch

from triptych.cache.mm import tenant_scope
from triptych.cache.mm_layer import encoder_layer
from triptych.errors import TriptychError
from triptych.server import protocol as P
from triptych.server import wire
from triptych.server.runners.base import Job, StageRunner, owned, specs_of
from triptych.server.runners.chat import ChatSession
from triptych.server.transfer.staging import to_host


class EncoderRunner(StageRunner):
    """Encodes run in arrival order. A chat runs beside them one token per ``execute()``, so an
    image request on the same encoder never waits for a long answer."""

    stage = "encode"
    tasks = (P.EncodeTask, P.ChatTask)

    def __init__(self, family, port):
        super().__init__(family, port)
        self.chats: list[tuple[Job, ChatSession | None]] = []  # in arrival order; the first one runs
        #: The encoder layer (``cache.mm_layer``): every execute() first encodes the images of the
        #: requests taken so far as one batched vision forward; a request runs once its images are in.
        self.layer = encoder_layer(family)
        self._chat_params: dict[str, object] = {}  # holder → the chat's parsed params, until it starts

    def take(self, task) -> None:
        if isinstance(task, P.ChatTask):
            job = self.new_job(task, None)
            try:
                params = self._chat_params[holder(job)] = wire.chat_from_wire(task)
            except (ValueError, OSError) as e:  # an image that does not decode (the head checked it)
                return self.port.fail(job, TriptychError(f"the chat's images do not decode: {e}"), retryable=False)
            self.chats.append((job, None))
        else:
            job = self.new_job(task, wire.params_from_wire(task.params))
            self.ready.append(job)
            params = job.params
        if self.layer is not None:
            self.layer.add(holder(job), params.tenant, self.family.vision_images(params))

    def has_work(self) -> bool:
        return bool(self.ready) or bool(self.chats)

    def execute(self) -> None:
        if self.layer is not None:
            self.layer.step()
        job = next((j for j in self.ready if self._vision_ready(j)), None)
        if job is not None:
            self.ready.remove(job)
            return self.run(job)
        if self.chats and self._vision_ready(self.chats[0][0]):
            self._chat_step()

    def _vision_ready(self, job: Job) -> bool:
        return self.layer is None or self.layer.ready(holder(job))

    def _release(self, job: Job) -> None:
        self._chat_params.pop(holder(job), None)
        if self.layer is not None:
            self.layer.release(holder(job))

    def run(self, job: Job) -> None:
        try:
            super().run(job)
        finally:  # the encode is over: its embeddings are no longer needed by it
            self._release(job)

    def compute(self, job: Job) -> None:
        with torch.no_grad(), tenant_scope(job.params.tenant):
            cond = self.family.encode(job.params)
        job.outgoing = to_host(owned(cond.flat()))
        self.port.send(P.EncodeDone(job.request_id, job.generation, self.port.instance_id, specs_of(job.outgoing)))

    def abort(self, job: Job) -> None:
        super().abort(job)
        self._release(job)
        for i, (held, session) in enumerate(self.chats):
            if held is job:
                del self.chats[i]
                if session is not None:
                    session.close()
                return

    def close(self) -> None:
        """A shutdown ends the running answer at its next token, answered as a retryable failure."""
        chats, self.chats = self.chats, []
        for job, session in chats:
            self._release(job)
            if session is not None:
                session.close()
                self.port.fail(job, TriptychError(f"{self.port.instance_id} is shutting down"), retryable=True)

    def cache_stats(self):
        cache = getattr(self.family, "mm_cache", None)
        return None if cache is None else cache.snapshot()

    # ---- chat -----------------------------------------------------------------------------------
    def _chat_step(self) -> None:
        job, session = self.chats[0]
        port = self.port
        if session is None:
            model = self.family.chat_model()
            if model is None:
                self.chats.pop(0)
                self._release(job)
                return port.fail(job, TriptychError(f"{port.instance_id} has no VLM to chat with"), retryable=False)
            params = self._chat_params.pop(holder(job), None) or wire.chat_from_wire(job.task)
            session = ChatSession(model, params, job.task.stream)
            self.chats[0] = (job, session)
        if port.stopping():
            session.close()
        else:
            session.step()
        for text in session.pieces:
            port.send(P.ChatDelta(job.request_id, job.generation, port.instance_id, text))
        session.pieces.clear()
        if session.done:
            self.chats.pop(0)
            self._release(job)
            self._chat_end(job, session)

    def _chat_end(self, job: Job, session: ChatSession) -> None:
        port = self.port
        if session.error is not None:
            error = session.error
            if not isinstance(error, TriptychError | RuntimeError | ValueError):
                raise error
            return port.fail(job, error, retryable=False)
        result = session.result
        if result.finish_reason == "cancelled":  # stopped by a shutdown (a head's cancel aborts the job)
            return port.fail(job, TriptychError(f"{port.instance_id} is shutting down"), retryable=True)
        port.finish(job)
        port.send(
            P.ChatDone(
                job.request_id,
                job.generation,
                port.instance_id,
                result.text,
                result.prompt_tokens,
                result.completion_tokens,
                result.finish_reason,
            )
        )


def holder(job: Job) -> str:
    """The id a job holds encoder-layer entries under (a newer generation is another holder)."""
    return f"{job.request_id}#{job.generation}"
