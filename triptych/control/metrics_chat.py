"""Where a chat's time to first token goes, per model: media decode at the head, queueing (head and
worker), the vision tower, prefill, the time to first token itself, and the gaps between streamed
pieces. The worker's stage times come with its answer (``ChatResult.timing``, from ``ChatDone``);
the head times the rest on its own clock (``ChatClock``, one per chat)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from triptych.chat.params import ChatResult
from triptych.core.buckets import CHAT_SECONDS_BOUNDS, INTER_TOKEN_SECONDS_BOUNDS


class ChatLatencyMetrics:
    """The chat latency histograms of one model's ``Metrics`` (``/metrics`` adds the ``model`` label)."""

    def __init__(self, registry: CollectorRegistry):
        def hist(name: str, doc: str, bounds=CHAT_SECONDS_BOUNDS) -> Histogram:
            return Histogram(name, doc, buckets=bounds, registry=registry)

        self.media_decode = hist(
            "triptych_chat_media_decode_seconds", "Time the head spent decoding a chat's images (data URLs)"
        )
        self.queue = hist(
            "triptych_chat_queue_seconds", "Time a chat waited at the head and at the worker before its prefill began"
        )
        self.vision_encode = hist(
            "triptych_chat_vision_encode_seconds", "Time the vision tower spent on a chat's images"
        )
        self.prefill = hist("triptych_chat_prefill_seconds", "Time of the prefill forwards a chat's prompt ran in")
        self.first_token = hist(
            "triptych_chat_time_to_first_token_seconds",
            "From the head's receipt of a chat to its first streamed piece (not streamed: its first token)",
        )
        self.inter_token = hist(
            "triptych_chat_inter_token_seconds",
            "Gap between consecutive streamed pieces of a chat as the head sends them",
            INTER_TOKEN_SECONDS_BOUNDS,
        )


class ChatClock:
    """One chat's times at the head, from ``t0`` (its receipt): ``piece()`` as each streamed piece
    is sent, ``finished()`` with its answer. ``decode_s``: the time its images took to decode."""

    def __init__(
        self,
        metrics: ChatLatencyMetrics,
        t0: float,
        decode_s: float,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.metrics, self.t0, self.decode_s, self.clock = metrics, t0, decode_s, clock
        self.last: float | None = None  # when the last piece was sent
        self.pieces = 0

    def piece(self) -> None:
        """A streamed piece is being sent: the first one's time to first token, then the gaps."""
        now = self.clock()
        if self.last is None:
            self.metrics.first_token.observe(now - self.t0)
        else:
            self.metrics.inter_token.observe(now - self.last)
        self.last, self.pieces = now, self.pieces + 1

    def finished(self, result: ChatResult) -> None:
        """The answer is in: its stages (each chat once in every stage histogram, so the means add
        up), and, when no piece was streamed, its time to first token (the head's time to the answer
        less the worker's from its first token to its last)."""
        self.metrics.media_decode.observe(self.decode_s)
        timing = result.timing
        if timing is None:  # an engine that does not time its stages (a remote one)
            return
        self.metrics.queue.observe(timing.head_queue_s + timing.queue_s)
        self.metrics.vision_encode.observe(timing.vision_s)
        self.metrics.prefill.observe(timing.prefill_s)
        if self.last is None:
            after_first = timing.total_s - timing.first_token_s
            self.metrics.first_token.observe(max(self.clock() - self.t0 - after_first, timing.first_token_s))
