"""The encoder's stage: encode, hold the conditioning, push it to the denoiser the head names; and
answer chats on the encoder's own VLM (the text encoder of Qwen-Image families is a Qwen2.5-VL)."""

from __future__ import annotations

import torch

from triptych.cache.mm import tenant_scope
from triptych.errors import TriptychError
from triptych.pipelines.vlm.engine_config import ChatEngineConfig
from triptych.server import protocol as P
from triptych.server import wire
from triptych.server.runners.base import Job, StageRunner, owned, specs_of
from triptych.server.transfer.staging import to_host


class EncoderRunner(StageRunner):
    """Encodes run in arrival order. Chats run in the chat engine (``pipelines.vlm.engine``): one
    engine step (every running chat advances one token, in one forward) per ``execute()``, taking
    turns with encodes while both have work, so an image request never waits for a long answer and
    a burst of encodes holds the chats back by one encode per token at most."""

    stage = "encode"
    tasks = (P.EncodeTask, P.ChatTask)

    def __init__(self, family, port, chat_config: ChatEngineConfig = ChatEngineConfig()):
        super().__init__(family, port)
        self.chat_config = chat_config
        self.engine = None  # the ChatEngine, built at the first chat
        self.chats: dict[tuple[str, int], Job] = {}  # engine chat id -> job, for the chats held
        self._chat_turn = False  # the next execute() is the chats' when encodes wait too

    def take(self, task) -> None:
        if not isinstance(task, P.ChatTask):
            self.ready.append(self.new_job(task, wire.params_from_wire(task.params)))
            return
        job = self.new_job(task, None)
        engine = self._chat_engine()
        if engine is None:
            return self.port.fail(
                job, TriptychError(f"{self.port.instance_id} has no VLM to chat with"), retryable=False
            )
        key = (job.request_id, job.generation)
        self.chats[key] = job
        engine.submit(key, wire.chat_from_wire(task), task.stream)

    def has_work(self) -> bool:
        return bool(self.ready) or (self.engine is not None and self.engine.has_work())

    def execute(self) -> None:
        chats = self.engine is not None and self.engine.has_work()
        if self.ready and not (chats and self._chat_turn):
            self._chat_turn = True
            return super().execute()
        self._chat_turn = False
        self._chat_step()

    def compute(self, job: Job) -> None:
        with torch.no_grad(), tenant_scope(job.params.tenant):
            cond = self.family.encode(job.params)
        job.outgoing = to_host(owned(cond.flat()))
        self.port.send(P.EncodeDone(job.request_id, job.generation, self.port.instance_id, specs_of(job.outgoing)))

    def abort(self, job: Job) -> None:
        super().abort(job)
        key = (job.request_id, job.generation)
        if self.chats.pop(key, None) is not None:
            self.engine.cancel(key)  # it leaves the batch at the next step, its KV freed

    def close(self) -> None:
        """A shutdown fails the running answers as retryable (another encoder answers them)."""
        chats, self.chats = self.chats, {}
        for key, job in chats.items():
            self.engine.cancel(key)
            self.port.fail(job, TriptychError(f"{self.port.instance_id} is shutting down"), retryable=True)

    def cache_stats(self):
        cache = getattr(self.family, "mm_cache", None)
        return None if cache is None else cache.snapshot()

    def chat_stats(self):
        return None if self.engine is None else self.engine.snapshot()

    # ---- chat -----------------------------------------------------------------------------------
    def _chat_engine(self):
        if self.engine is None:
            model = self.family.chat_model()
            if model is None:
                return None
            from triptych.pipelines.vlm.engine import ChatEngine

            self.engine = ChatEngine(model, self.chat_config)
        return self.engine

    def _chat_step(self) -> None:
        port = self.port
        if port.stopping():
            for key in self.chats:
                self.engine.cancel(key)
        for chat in self.engine.step():
            job = self.chats.get(chat.id)
            if job is None:  # aborted: nothing more goes to the head
                continue
            for text in chat.pieces:
                port.send(P.ChatDelta(job.request_id, job.generation, port.instance_id, text))
            chat.pieces.clear()
            if chat.done:
                del self.chats[chat.id]
                self._chat_end(job, chat)

    def _chat_end(self, job: Job, chat) -> None:
        port = self.port
        if chat.error is not None:
            return port.fail(job, chat.error, retryable=False)
        result = chat.result
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
