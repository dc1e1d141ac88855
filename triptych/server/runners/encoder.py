"""The encoder's stage: encode, hold the conditioning, push it to the denoiser the head names; and
answer chats on the encoder's own VLM (the text encoder of Qwen-Image families is a Qwen2.5-VL)."""

from __future__ import annotations

import torch

from triptych.cache.mm import tenant_scope
from triptych.errors import TriptychError
from triptych.server import protocol as P
from triptych.server import wire
from triptych.server.runners.base import Job, StageRunner, owned, specs_of
from triptych.server.runners.chat import ChatSession
from triptych.server.runners.remote_chat import RemoteChats
from triptych.server.transfer.staging import to_host


class EncoderRunner(StageRunner):
    """Encodes run in arrival order. A chat runs beside them one token per ``execute()``, so an
    image request on the same encoder never waits for a long answer."""

    stage = "encode"
    tasks = (P.EncodeTask, P.ChatTask)

    def __init__(self, family, port, chat_engine=None):
        """``chat_engine``: a remote LLM engine (``triptych.vllm_chat.engine.VllmChatEngine``) that
        answers the chats (this encoder encodes their images); None: the built-in decoder."""
        super().__init__(family, port)
        self.chats: list[tuple[Job, ChatSession | None]] = []  # in arrival order; the first one runs
        self.remote = None if chat_engine is None else RemoteChats(family, port, chat_engine)

    def take(self, task) -> None:
        if isinstance(task, P.ChatTask) and self.remote is not None:
            self.remote.take(self.new_job(task, None))
        elif isinstance(task, P.ChatTask):
            self.chats.append((self.new_job(task, None), None))
        else:
            self.ready.append(self.new_job(task, wire.params_from_wire(task.params)))

    def has_work(self) -> bool:
        return bool(self.ready) or bool(self.chats) or (self.remote is not None and self.remote.has_work())

    def execute(self) -> None:
        if self.remote is not None and self.remote.has_work():
            return self.remote.step()
        if self.ready:
            return super().execute()
        self._chat_step()

    def compute(self, job: Job) -> None:
        with torch.no_grad(), tenant_scope(job.params.tenant):
            cond = self.family.encode(job.params)
        job.outgoing = to_host(owned(cond.flat()))
        self.port.send(P.EncodeDone(job.request_id, job.generation, self.port.instance_id, specs_of(job.outgoing)))

    def abort(self, job: Job) -> None:
        super().abort(job)
        if self.remote is not None and self.remote.abort(job):
            return
        for i, (held, session) in enumerate(self.chats):
            if held is job:
                del self.chats[i]
                if session is not None:
                    session.close()
                return

    def close(self) -> None:
        """A shutdown ends the running answer at its next token, answered as a retryable failure."""
        if self.remote is not None:
            self.remote.close()
        chats, self.chats = self.chats, []
        for job, session in chats:
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
                return port.fail(job, TriptychError(f"{port.instance_id} has no VLM to chat with"), retryable=False)
            session = ChatSession(model, wire.chat_from_wire(job.task), job.task.stream)
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
