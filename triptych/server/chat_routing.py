"""The head's chat routing (the VLM path), mixed into ``Orchestrator``.

A chat is one chat-capable encoder's work: the head charges one of its slots, sends a ``ChatTask``,
hands each ``ChatDelta`` to the caller and ends on ``ChatDone`` or ``StageError``. No tensor moves.
A chat whose encoder dies (or fails retryably) before any piece reached the caller is retried once
on another chat-capable encoder under a new generation; after a piece it fails, so a client never
sees an answer start twice. A rule only the worker can check (prompt + ``max_tokens`` within the
model's context) comes back as the user's ``InvalidParam``. Like the rest of the orchestrator, all
state lives on its event loop; nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from triptych.errors import InvalidParam
from triptych.pipelines.vlm import ChatResult
from triptych.server import protocol as P
from triptych.server.backend import ChatJob, Overloaded, StageFailed, TextFn

logger = logging.getLogger("triptych.server.orchestrator")


@dataclass
class ChatTracked:
    """One live chat on the head: queued, then on one chat-capable encoder instance."""

    job: ChatJob
    future: asyncio.Future
    on_text: TextFn | None
    deadline: float  # monotonic
    generation: int = 0
    instance: str | None = None  # the encoder charged a slot for it
    retries: int = 0
    streamed: bool = False  # a piece reached the client: it cannot be retried elsewhere
    avoid: set[str] = field(default_factory=set)


class ChatRouting:
    """Chat methods of ``Orchestrator`` (uses its instances, policies, config, stats and socket)."""

    def _init_chats(self) -> None:
        self._chats: dict[str, ChatTracked] = {}
        self._wait_chat: deque[str] = deque()

    def _end_chats(self, which: Callable[[ChatTracked], bool], error: Callable[[ChatTracked], Exception]) -> int:
        """End every chat ``which`` selects with ``error(chat)`` (shutdown, cancel, timeout); returns how many."""
        ended = [ct for ct in self._chats.values() if which(ct)]
        for ct in ended:
            self._chat_end(ct, error=error(ct))
        return len(ended)

    def _retry_chats_on(self, instance_id: str, why: str) -> None:
        for ct in [c for c in self._chats.values() if c.instance == instance_id]:
            self._chat_retry(ct, why)

    async def chat(self, job: ChatJob, on_text: TextFn | None = None) -> ChatResult:
        rid = job.request_id
        assert self._sock is not None, "Orchestrator.start() was not called"
        if not self.family.supports_chat:
            raise InvalidParam("model", self.model_dir.name, "this model has no VLM to chat with")
        if len(self._wait_chat) >= self.config.max_queued:
            raise Overloaded(f"chat queue is full ({self.config.max_queued} requests)", retry_after=1.0)
        if rid in self._chats or rid in self._requests:
            raise ValueError(f"request id {rid!r} is already running")
        future = asyncio.get_running_loop().create_future()
        self._chats[rid] = ChatTracked(job, future, on_text, time.monotonic() + self.config.chat_timeout_s)
        self._wait_chat.append(rid)
        self._pump()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the client went away: stop the worker at its next token
            await self.cancel(rid)
            if not future.cancelled():
                future.exception()
            raise

    def _pump_chats(self) -> None:
        while self._wait_chat:
            ct = self._chats[self._wait_chat[0]]
            pool = [i for i in self.pool("encoder") if i.chat]
            avoid = frozenset(ct.avoid) if not all(i.instance_id in ct.avoid for i in pool) else frozenset()
            inst = self._policies["encoder"].pick(pool, exclude=avoid)
            if inst is None:
                return
            self._wait_chat.popleft()
            inst.hold(ct.job.request_id)
            ct.instance = inst.instance_id
            self._send(inst.instance_id, P.chat_to_wire(ct.job.request_id, ct.generation, ct.job.params, ct.job.stream))

    def _on_chat_message(self, msg) -> None:
        ct = self._chats.get(msg.request_id)
        if ct is None or msg.generation != ct.generation or msg.instance_id != ct.instance:
            # e.g. pieces already on the wire when a cancelled chat ended; a ChatDone here would mean
            # the worker finished a chat it had been told to stop
            self.stats[f"{type(msg).__name__}_{'after_end' if ct is None else 'stale'}"] += 1
            return
        if isinstance(msg, P.ChatDelta):
            ct.streamed = True
            if ct.on_text is not None:
                ct.on_text(msg.text)
        elif isinstance(msg, P.ChatDone):
            self._chat_end(ct, result=ChatResult(msg.text, msg.prompt_tokens, msg.completion_tokens, msg.finish_reason))
        elif isinstance(msg, P.StageError):
            if msg.invalid is not None:
                self._chat_end(ct, error=InvalidParam(*msg.invalid))
            elif msg.retryable:
                self._chat_retry(ct, f"chat failed on {msg.instance_id}: {msg.message}")
            else:
                self._chat_end(ct, error=StageFailed(f"chat failed on {msg.instance_id}: {msg.message}"))

    def _chat_retry(self, ct: ChatTracked, why: str) -> None:
        """Once elsewhere, while nothing was streamed yet (a client never sees two beginnings)."""
        if ct.streamed or ct.retries >= self.config.max_retries:
            reason = "part of the answer was sent" if ct.streamed else f"retries exhausted ({ct.retries})"
            return self._chat_end(ct, error=StageFailed(f"{why}; no retry: {reason}"))
        self._chat_release(ct, cancel_worker=True, reason=f"retry: {why}")
        ct.avoid.add(ct.instance)
        ct.instance = None
        ct.retries += 1
        ct.generation += 1
        self._wait_chat.appendleft(ct.job.request_id)
        self.stats["chat_retries"] += 1
        logger.warning("retrying chat %s as generation %d: %s", ct.job.request_id, ct.generation, why)

    def _chat_release(self, ct: ChatTracked, cancel_worker: bool, reason: str) -> None:
        rid = ct.job.request_id
        if rid in self._wait_chat:
            self._wait_chat.remove(rid)
        if ct.instance is not None:
            if cancel_worker:
                self._send(ct.instance, P.Cancel(rid, ct.generation, reason))
            if ct.instance in self.instances:
                self.instances[ct.instance].unhold(rid)

    def _chat_end(self, ct: ChatTracked, result: ChatResult | None = None, error: Exception | None = None) -> None:
        rid = ct.job.request_id
        self._chat_release(ct, cancel_worker=error is not None, reason=type(error).__name__ if error else "done")
        del self._chats[rid]
        self.stats["chat_done" if error is None else "chat_" + type(error).__name__.lower()] += 1
        if not ct.future.done():
            ct.future.set_exception(error) if error is not None else ct.future.set_result(result)
