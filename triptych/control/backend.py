"""The edge between the HTTP head and whatever executes generations.

``GenerationBackend`` is what the REST layer calls. Two implementations:
- ``InProcessBackend`` (here): runs the stages in the head's process; for tests of the REST layer
  and tiny single-process deployments.
- the disaggregated orchestrator (``triptych.control.orchestrator``): routes each job through the
  encoder, denoiser and decoder pools; tensors move peer to peer, never through the head.

Errors a backend raises: ``InvalidParam`` (400), ``Overloaded`` (429 + Retry-After),
``Cancelled`` (the job was cancelled), ``StageFailed`` (a worker failed; message is user-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from triptych.chat import ChatParams, ChatResult
from triptych.control.metrics import Metrics
from triptych.core.errors import InvalidParam, TriptychError
from triptych.families.params import GenerationParams

if TYPE_CHECKING:  # the head holds a family without importing torch; a backend is given a loaded one
    from triptych.families.base import Family

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]  # (steps done, total steps)
PreviewFn = Callable[[int, bytes], None]  # (0-based partial image index, the preview in the job's format)


class Overloaded(TriptychError):
    """Admission refused: too many queued requests. ``retry_after`` seconds is a hint for clients."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(TriptychError):
    """A role the job needs has had no live instance for longer than the grace period (HTTP 503 with
    Retry-After), instead of waiting out the queue timeout."""

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineRefused(Overloaded):
    """Refused at once: the head's estimate says the job cannot finish within its ``deadline_s``
    (HTTP 429 + Retry-After: about when the work ahead of it will have drained enough)."""


class DeadlineMissed(TriptychError):
    """The job's ``deadline_s`` passed while it waited, before its denoising started: dropped, not
    run, everything it held freed (HTTP 504)."""

    def __init__(self, deadline_s: float, waited_s: float):
        super().__init__(
            f"deadline_s={deadline_s:g} passed after {waited_s:.1f}s of waiting, before denoising started; "
            "the request was dropped, not run"
        )
        self.deadline_s = deadline_s


class Cancelled(TriptychError):
    """The job was cancelled (DELETE, client disconnect) before it finished."""


class StageFailed(TriptychError):
    """A stage failed and retries are exhausted; the message is safe to show to users."""


@dataclass(frozen=True)
class GenerationJob:
    """One generation: resolved params plus how to encode the output."""

    request_id: str
    params: GenerationParams  # already passed through Family.resolve
    output_format: str  # png | jpeg | webp | mp4
    fps: int = 16
    quality: int | None = None  # jpeg/webp quality (OpenAI's output_compression); None: the default
    partial_images: int = 0  # previews wanted (0..3, ``engine.previews``), delivered to ``on_preview``
    #: ``time.monotonic()`` past which nobody waits for the answer (the HTTP head's ``request_timeout_s``
    #: from the request's start); a retry waiting for a replacement instance gives up then. None: no
    #: deadline of its own (a video job), only the backend's bounds.
    deadline: float | None = None
    weight: float = 1.0  # its tenant's share in the head's fair queue (``fair_queue``); priority: in params
    deadline_s: float | None = None  # seconds from its arrival its client can wait; None: no deadline
    deadline_at: float | None = None  # that moment on the head's ``time.monotonic`` clock


@dataclass(frozen=True)
class ChatJob:
    """One chat completion: checked ``ChatParams``; ``stream``: deliver pieces as they are decoded."""

    request_id: str
    params: ChatParams
    stream: bool = False
    priority: int = 0  # its priority class in the head's chat queue: lower sooner
    weight: float = 1.0  # its tenant's share in that queue (``fair_queue``)


TextFn = Callable[[str], None]  # one streamed piece of a chat answer


class GenerationBackend(ABC):
    """Runs jobs. ``family`` is a weightless adapter (configs and scheduler only) for validation."""

    family: Family

    @functools.cached_property
    def metrics(self) -> Metrics:
        """The head's Prometheus collectors: one set per backend, shared with the HTTP head (a backend
        that builds its own assigns it in ``__init__``)."""
        return Metrics()

    async def start(self) -> None:
        """Start workers/connections; called once before the first ``run``."""

    async def close(self) -> None:
        """Stop; cancels in-flight jobs and frees what they hold."""

    @abstractmethod
    async def run(
        self, job: GenerationJob, on_progress: ProgressFn | None = None, on_preview: PreviewFn | None = None
    ) -> bytes:
        """Run ``job`` to completion and return the encoded media bytes. ``on_preview`` gets each of
        ``job.partial_images`` previews (fewer when the job has too few steps), in order, before this
        returns; it is called on the event loop and must not block."""

    def check_deadlines(self, jobs: list[GenerationJob]) -> None:
        """Raise ``DeadlineRefused`` when ``jobs`` (one request's, queued now) cannot finish within
        their ``deadline_s`` by this backend's estimate; a backend without one admits them."""

    @abstractmethod
    async def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running job; True if it was known. Frees its slots and cache refs."""

    async def chat(self, job: ChatJob, on_text: TextFn | None = None) -> ChatResult:
        """Answer a chat with the model's VLM (``family.supports_chat``); ``on_text`` gets each piece."""
        raise InvalidParam("model", self.family.name, "this backend does not serve chat")

    def describe(self) -> dict:
        """Instances and their state, for ``/health`` and metrics."""
        return {}


class InProcessBackend(GenerationBackend):
    """Runs one generation at a time in a worker thread of the head process (no pools); chats run in
    one batched chat engine there, an engine step at a time between generations."""

    def __init__(self, family: Family, max_queued: int = 64):
        from triptych.engine.teacache import make_teacache

        self.family = family
        self._accel = make_teacache(family)
        self.max_queued = max_queued
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._active: set[str] = set()  # queued or running request ids
        self._cancelled: set[str] = set()  # subset of _active
        self._chats = None  # InProcessChats, built at the first chat

    @contextlib.asynccontextmanager
    async def _turn(self, request_id: str, job: GenerationJob | None = None):
        """Queue for the one execution slot (admission, cancel before start, a ``job`` whose deadline
        passed while it waited dropped, bookkeeping after)."""
        if self._waiting >= self.max_queued:
            raise Overloaded(f"queue is full ({self.max_queued} requests)", retry_after=1.0)
        self._waiting += 1
        self._active.add(request_id)
        try:
            async with self._lock:
                if request_id in self._cancelled:
                    raise Cancelled(request_id)
                now = time.monotonic()
                if job is not None and job.deadline_at is not None and now >= job.deadline_at:
                    raise DeadlineMissed(job.deadline_s, job.deadline_s + now - job.deadline_at)
                yield
        finally:
            self._waiting -= 1
            self._active.discard(request_id)
            self._cancelled.discard(request_id)

    async def run(
        self, job: GenerationJob, on_progress: ProgressFn | None = None, on_preview: PreviewFn | None = None
    ) -> bytes:
        from triptych.core.media import encode_frames
        from triptych.engine.runner import run_request

        loop = asyncio.get_running_loop()

        def preview(index: int, frames) -> None:
            data = encode_frames(frames.to_uint8(), job.output_format, job.fps, job.quality)
            loop.call_soon_threadsafe(on_preview, index, data)

        async with self._turn(job.request_id, job):

            def on_step(state):
                if job.request_id in self._cancelled:
                    raise Cancelled(job.request_id)
                if on_progress is not None:
                    on_progress(state.step, state.total_steps)

            frames, _ = await asyncio.to_thread(
                run_request,
                self.family,
                job.params,
                job.request_id,
                on_step,
                True,
                self._accel,
                job.partial_images if on_preview is not None else 0,
                preview,
            )
            return await asyncio.to_thread(encode_frames, frames.to_uint8(), job.output_format, job.fps, job.quality)

    async def cancel(self, request_id: str) -> bool:
        if self._chats is not None and self._chats.cancel(request_id):
            return True
        if request_id not in self._active:
            return False
        self._cancelled.add(request_id)
        return True

    async def chat(self, job: ChatJob, on_text: TextFn | None = None) -> ChatResult:
        """In the head's process, in one chat engine (``inprocess_chat``): chats decode together, one
        forward per token, taking turns with generations for the model; a cancel ends the chat at
        the next token."""
        model = self.family.chat_model()
        if model is None:
            raise InvalidParam("model", self.family.name, "this model has no VLM to chat with")
        if self._chats is None:
            from triptych.control.inprocess_chat import InProcessChats

            self._chats = InProcessChats(model, self._lock)
        if len(self._chats) + self._waiting >= self.max_queued:
            raise Overloaded(f"queue is full ({self.max_queued} requests)", retry_after=1.0)
        result = await self._chats.chat(job.request_id, job.params, job.stream, on_text)
        if result.finish_reason == "cancelled":
            raise Cancelled(job.request_id)
        return result
