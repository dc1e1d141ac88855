"""Chat routing on the head (the VLM path): one chat-capable encoder answers each chat.

A chat is a request like a generation, with its own table on the same state machine (QUEUED →
CHATTING → DONE, or FAILED / CANCELLED / TIMED_OUT) and the same lifecycle (``lifecycle.Lifecycle``:
admission, cancel, expiry, retries with ``Attempts``, endings; the generation router composes it too).
The head charges one of a chat-capable encoder's chat slots (``Register.chat_slots``: its engine's
running chats plus a queue, apart from its encode slots), sends a ``ChatTask``, hands each ``ChatDelta``
to the caller and ends on ``ChatDone`` or ``StageError``. No tensor moves. A chat whose encoder
dies (or fails retryably) before any piece reached the caller is retried on another chat-capable
encoder under a new generation; after a piece it fails, so a client never sees an answer start
twice. A rule only the worker can check (prompt + ``max_tokens`` within the model's context) comes
back as the user's ``InvalidParam``. All state lives on the head's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from triptych.chat import ChatResult
from triptych.control import protocol as P
from triptych.control import wire
from triptych.control.attempts import Attempts
from triptych.control.backend import ChatJob, StageFailed, TextFn
from triptych.control.counters import LifecycleCounters
from triptych.control.dispatch import ChatSlots
from triptych.control.lifecycle import Lifecycle
from triptych.control.registry import InstanceRegistry
from triptych.control.request_state import CHAT_TRANSITIONS, RequestMachine, RequestState, StateTimeouts
from triptych.core.errors import InvalidParam
from triptych.core.kinds import Role

logger = logging.getLogger(__name__)
S = RequestState


@dataclass
class ChatTracked:
    """One live chat on the head: queued, then on one chat-capable encoder instance."""

    job: ChatJob
    machine: RequestMachine
    future: asyncio.Future
    on_text: TextFn | None
    images_png: list[bytes] | None = None  # the images as sent on the wire (encoded off the loop)
    instance: str | None = None  # the encoder charged a slot for it
    streamed: bool = False  # a piece reached the client: it cannot be retried elsewhere
    attempts: Attempts = field(default_factory=Attempts)
    submitted: float = field(default_factory=time.perf_counter)
    dispatched: float | None = None  # when it was last sent to an encoder


class ChatRouter:
    def __init__(
        self,
        *,
        registry: InstanceRegistry,
        send: Callable[[str, P.Message], None],
        counters: LifecycleCounters,
        timeouts: StateTimeouts,
        max_retries: int,
        max_queued: int,
    ):
        self.registry = registry
        self.send = send
        self.counters = counters
        self.policy = ChatSlots()  # chats count against an encoder's chat slots, not its encode slots
        self.lifecycle: Lifecycle[ChatTracked] = Lifecycle(
            kind="chat",
            table=CHAT_TRANSITIONS,
            timeouts=timeouts,
            max_retries=max_retries,
            max_queued=max_queued,
            counters=counters,
            release=self._release,
        )
        self.chats = self.lifecycle.requests
        self.waiting = self.lifecycle.queue

    def submit(self, job: ChatJob, on_text: TextFn | None, images_png: list[bytes] | None = None) -> asyncio.Future:
        """``images_png``: ``wire.chat_images(job.params)`` made already (off the event loop: large
        images take seconds to encode); None = made at each dispatch."""
        future = asyncio.get_running_loop().create_future()
        tracked = ChatTracked(job, self.lifecycle.machine(job.request_id), future, on_text, images_png)
        self.lifecycle.admit(tracked, job.priority, job.params.tenant, job.weight)
        return future

    def cancel(self, request_id: str) -> bool:
        return self.lifecycle.cancel(request_id)

    def end_all(self, error: Callable[[str], Exception]) -> None:
        self.lifecycle.end_all(error)

    def expire(self, now: float) -> None:
        self.lifecycle.expire(now)

    def owns(self, msg) -> bool:
        return msg.request_id in self.chats or isinstance(msg, P.ChatDelta | P.ChatDone)

    def instance_lost(self, instance_id: str, why: str) -> None:
        for ct in [c for c in self.chats.values() if c.instance == instance_id]:
            self._retry(ct, why)

    def describe(self) -> dict:
        return {"chats": len(self.chats), "queue": len(self.waiting), "tenants": dict(self.waiting.served)}

    def backlog(self, now: float) -> tuple[int, float]:
        """The chats waiting for a chat-capable encoder slot, and how long the first has waited."""
        return self.lifecycle.backlog(now)

    def pump(self) -> None:
        while self.waiting:
            ct = self.chats[self.waiting[0]]
            pool = [i for i in self.registry.pool(Role.ENCODER) if i.chat]
            affinity = self.registry.affinity
            if ct.attempts.image_keys is None:
                ct.attempts.image_keys = affinity.keys(ct.job.params.tenant, ct.job.params.images)
            inst = ct.attempts.pick(self.policy, Role.ENCODER, pool, affinity, chat=True)
            if inst is None:
                return
            self.waiting.take(ct.job.request_id)
            inst.hold_chat(ct.job.request_id)
            affinity.record(ct.attempts.image_keys, inst.instance_id)
            ct.instance = inst.instance_id
            ct.machine.to(S.CHATTING)
            ct.dispatched = time.perf_counter()
            hints = affinity.hints(ct.attempts.image_keys, inst.instance_id, self.registry.addresses(Role.ENCODER))
            task = wire.chat_to_wire(
                ct.job.request_id, ct.machine.generation, ct.job.params, ct.job.stream, ct.images_png, hints
            )
            self.send(inst.instance_id, task)

    def handle(self, msg) -> None:
        ct = self.chats.get(msg.request_id)
        if ct is None or msg.generation != ct.machine.generation or msg.instance_id != ct.instance:
            # e.g. pieces already on the wire when a cancelled chat ended; a ChatDone here would mean
            # the worker finished a chat it had been told to stop
            if ct is not None:
                self.counters.dropped_stale += 1
            elif isinstance(msg, P.ChatDone):
                self.counters.done_after_end += 1
            else:
                self.counters.dropped_after_end += 1
            return
        if isinstance(msg, P.ChatDelta):
            ct.streamed = True
            if ct.on_text is not None:
                ct.on_text(msg.text)
        elif isinstance(msg, P.ChatDone):
            self.registry.affinity.held(ct.attempts.image_keys or [], msg.instance_id, msg.images)
            timing = msg.timing
            if timing is not None and ct.dispatched is not None:  # its time in the head's queue (and retries)
                timing = msgspec.structs.replace(timing, head_queue_s=ct.dispatched - ct.submitted)
            result = ChatResult(msg.text, msg.prompt_tokens, msg.completion_tokens, msg.finish_reason, timing)
            self.lifecycle.finish(ct, S.DONE, result=result)
        elif isinstance(msg, P.StageError):
            if msg.invalid is not None:
                self.counters.invalid += 1
                self.lifecycle.finish(ct, S.FAILED, error=InvalidParam(*msg.invalid))
            elif msg.retryable:
                self._retry(ct, f"chat failed on {msg.instance_id}: {msg.message}")
            else:
                error = StageFailed(f"chat failed on {msg.instance_id}: {msg.message}")
                self.lifecycle.finish(ct, S.FAILED, error=error)

    def _retry(self, ct: ChatTracked, why: str) -> None:
        """Elsewhere, while nothing was streamed yet (a client never sees two beginnings)."""
        refusal = "part of the answer was sent" if ct.streamed else ct.attempts.refusal(self.lifecycle.max_retries)
        refusal = None if refusal is None else f"no retry: {refusal}"
        self.lifecycle.retry(ct, why, refusal, Role.ENCODER, ct.instance)

    def _release(self, ct: ChatTracked, cancel_reason: str | None) -> None:
        """The lifecycle's release: its chat slot freed (``Cancel`` sent to the encoder with a reason)."""
        if ct.instance is not None:
            rid = ct.job.request_id
            if cancel_reason is not None:
                self.send(ct.instance, P.Cancel(request_id=rid, generation=ct.machine.generation, reason=cancel_reason))
            inst = self.registry.instances.get(ct.instance)
            if inst is not None:
                inst.unhold(rid)
            ct.instance = None
