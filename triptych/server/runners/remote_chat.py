"""Chats answered by a remote LLM engine (vLLM): this encoder encodes, the engine decodes.

The encoder's part of a chat is what it does for an edit: preprocess the images and run its vision
tower through the mm-hash cache (``family.vllm_inputs``). The embeddings go to the engine with their
mm-hashes (``triptych.vllm_chat.engine``), which streams the answer back; the pieces become the
same ``ChatDelta`` / ``ChatDone`` / ``StageError`` messages the built-in engine sends, so the head
cannot tell the engines apart. Chats are submitted one per ``step()`` (the vision forward runs on
the loop thread, between encodes) and then decode concurrently inside the engine.
"""

from __future__ import annotations

import logging
from collections import deque

from triptych.errors import InvalidParam, TriptychError
from triptych.server import protocol as P
from triptych.server import wire
from triptych.server.runners.base import Job, WorkerPort
from triptych.vllm_chat.engine import VllmChatEngine, VllmUnavailable, chat_body

logger = logging.getLogger(__name__)


def _key(job: Job) -> str:
    return f"{job.request_id}#{job.generation}"


class RemoteChats:
    """The encoder runner's chats when a remote engine answers them (see the module docstring)."""

    def __init__(self, family, port: WorkerPort, engine: VllmChatEngine):
        self.family = family
        self.port = port
        self.engine = engine
        self.waiting: deque[Job] = deque()  # not yet sent: their images are encoded in turn
        self.running: dict[str, Job] = {}  # sent, by engine key

    def take(self, job: Job) -> None:
        self.waiting.append(job)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.engine.has_events()

    def step(self) -> None:
        """Hand on what the engine answered, then send the next waiting chat."""
        for event in self.engine.poll():
            self._event(event)
        if self.waiting:
            self._send(self.waiting.popleft())

    def abort(self, job: Job) -> bool:
        """Forget ``job`` (cancelled or superseded); True if it was one of these chats."""
        if job in self.waiting:
            self.waiting.remove(job)
            return True
        key = _key(job)
        if self.running.pop(key, None) is not None:
            self.engine.cancel(key)
            return True
        return False

    def close(self) -> None:
        """A shutdown: every chat here is answered as a retryable failure."""
        self.engine.close()
        jobs = [*self.waiting, *self.running.values()]
        self.waiting.clear()
        self.running.clear()
        for job in jobs:
            self.port.fail(job, TriptychError(f"{self.port.instance_id} is shutting down"), retryable=True)

    # ---- internals --------------------------------------------------------------------------------
    def _send(self, job: Job) -> None:
        port = self.port
        try:
            self.engine.connect()
            params = wire.chat_from_wire(job.task)
            prompt_tokens, items = self.family.vllm_inputs(params)
            limit = self.engine.max_model_len
            if limit and prompt_tokens + params.max_tokens > limit:
                raise InvalidParam(
                    "max_tokens",
                    params.max_tokens,
                    f"the prompt is {prompt_tokens} tokens and prompt + max_tokens must fit "
                    f"the chat engine's context of {limit} tokens",
                )
            body = chat_body(self.engine.model, params, items, stream=job.task.stream)
        except VllmUnavailable as e:
            return port.fail(job, e, retryable=True)
        except (TriptychError, RuntimeError, ValueError) as e:
            return port.fail(job, e, retryable=False)
        key = _key(job)
        self.running[key] = job
        self.engine.submit(key, body)

    def _event(self, event) -> None:
        job = self.running.get(event.key)
        if job is None:  # cancelled meanwhile: its last pieces are dropped
            return
        port = self.port
        if event.error is not None:
            del self.running[event.key]
            return port.fail(job, event.error, retryable=event.retryable)
        if event.result is None:
            if job.task.stream:
                port.send(P.ChatDelta(job.request_id, job.generation, port.instance_id, event.text))
            return
        del self.running[event.key]
        r = event.result
        port.finish(job)
        port.send(
            P.ChatDone(
                job.request_id,
                job.generation,
                port.instance_id,
                r.text,
                r.prompt_tokens,
                r.completion_tokens,
                r.finish_reason,
            )
        )
