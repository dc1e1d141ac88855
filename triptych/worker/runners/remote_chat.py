"""Chats answered by a remote LLM engine (vLLM): this encoder encodes, the engine decodes.

The encoder's part of a chat is what it does for an edit: preprocess the images and run its vision
tower through the mm-hash cache (``family.vllm_inputs``). The embeddings go to the engine with their
mm-hashes (``triptych.vllm_chat.engine``), which streams the answer back; the pieces become the
same ``ChatDelta`` / ``ChatDone`` / ``StageError`` messages the built-in engine sends, so the head
cannot tell the engines apart.

A chat's images join the encoder layer at ``take`` (``mmcache.layer``: the vision misses of every
waiting request, chats and edits alike, run as one batched forward per step) and the chat holds its
entries until it ends. Every ``step()`` submits ALL the waiting chats whose images the layer holds
(their embeddings are then cache hits), in one hand-over to the engine's thread; they decode concurrently inside the engine, whose HTTP
client runs on its own thread, so the loop never waits on vLLM.
"""

from __future__ import annotations

import logging

from triptych.control import protocol as P
from triptych.control import wire
from triptych.core.errors import InvalidParam, TriptychError
from triptych.mmcache.layer import EncoderLayer
from triptych.vllm_chat.engine import VllmChatEngine, VllmUnavailable, chat_body
from triptych.worker.runners.base import Job, WorkerPort

logger = logging.getLogger(__name__)


def _key(job: Job) -> str:
    """The chat's engine key, also the id its encoder-layer entries are held under."""
    return f"{job.request_id}#{job.generation}"


class RemoteChats:
    """The encoder runner's chats when a remote engine answers them (see the module docstring)."""

    def __init__(self, family, port: WorkerPort, engine: VllmChatEngine, layer: EncoderLayer | None = None):
        """``layer``: the encoder runner's layer (None: each chat's images are encoded at its send)."""
        self.family = family
        self.port = port
        self.engine = engine
        self.layer = layer
        self.waiting: dict[str, tuple[Job, object]] = {}  # not yet sent (job, ChatParams), arrival order
        self.running: dict[str, Job] = {}  # sent, by engine key

    def take(self, job: Job) -> None:
        try:
            params = wire.chat_from_wire(job.task)
        except (ValueError, OSError) as e:  # an image that does not decode (the head checked it)
            return self.port.fail(job, TriptychError(f"the chat's images do not decode: {e}"), retryable=False)
        key = _key(job)
        self.waiting[key] = (job, params)
        if self.layer is not None:
            self.layer.add(key, params.tenant, self.family.vision_images(params))

    def has_work(self) -> bool:
        return bool(self.waiting) or self.engine.has_events()

    def step(self) -> None:
        """Hand on what the engine answered, then send every waiting chat whose images are in."""
        for event in self.engine.poll():
            self._event(event)
        ready = []
        for key, (job, params) in list(self.waiting.items()):
            if self.layer is None or self.layer.ready(key):
                del self.waiting[key]
                ready.extend(self._request(job, params))
        self.engine.submit_all(ready)  # one hand-over to the engine's thread for the whole step

    def abort(self, job: Job) -> bool:
        """Forget ``job`` (cancelled, superseded or failed); True if it was one of these chats."""
        key = _key(job)
        self._release(key)
        if self.waiting.pop(key, None) is not None:
            return True
        if self.running.pop(key, None) is not None:
            self.engine.cancel(key)
            return True
        return False

    def close(self) -> None:
        """A shutdown: every chat here is answered as a retryable failure."""
        self.engine.close()
        jobs = [*(job for job, _ in self.waiting.values()), *self.running.values()]
        self.waiting.clear()
        self.running.clear()
        for job in jobs:
            self._release(_key(job))
            self.port.fail(job, TriptychError(f"{self.port.instance_id} is shutting down"), retryable=True)

    # ---- internals --------------------------------------------------------------------------------
    def _release(self, key: str) -> None:
        if self.layer is not None:
            self.layer.release(key)

    def _request(self, job: Job, params) -> list[tuple[str, dict]]:
        """The chat's (key, body) for the engine, or [] if it failed here (answered as such)."""
        port = self.port
        try:
            self.engine.connect()
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
            port.fail(job, e, retryable=True)
            return []
        except (TriptychError, RuntimeError, ValueError) as e:
            port.fail(job, e, retryable=False)
            return []
        key = _key(job)
        self.running[key] = job
        return [(key, body)]

    def _event(self, event) -> None:
        job = self.running.get(event.key)
        if job is None:  # cancelled meanwhile: its last pieces are dropped
            return
        port = self.port
        if event.error is not None:
            del self.running[event.key]
            self._release(event.key)
            return port.fail(job, event.error, retryable=event.retryable)
        if event.result is None:
            if job.task.stream:
                port.send(
                    P.ChatDelta(
                        request_id=job.request_id,
                        generation=job.generation,
                        instance_id=port.instance_id,
                        text=event.text,
                    )
                )
            return
        del self.running[event.key]
        self._release(event.key)
        r = event.result
        port.finish(job)
        port.send(
            P.ChatDone(
                request_id=job.request_id,
                generation=job.generation,
                instance_id=port.instance_id,
                text=r.text,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                finish_reason=r.finish_reason,
            )
        )
