"""Where one chat's time to first token went on the worker (``ChatTiming``): plain msgspec data, no
torch (the head reads it from ``ChatDone`` and records it, ``control.metrics_chat``).

Every duration is on the worker's clock from the moment it took the chat, and the stages are
disjoint intervals before the first token: ``queue_s + vision_s + prefill_s <= first_token_s``."""

from __future__ import annotations

import msgspec


class ChatTiming(msgspec.Struct, kw_only=True, frozen=True):
    """One chat's stage times (seconds); sent as they are in ``protocol.ChatDone.timing``."""

    queue_s: float = 0.0  # taken → its prefill's first chunk began, less the vision time spent meanwhile
    vision_s: float = 0.0  # the vision tower on its images (the encoder layer's batched steps and its chunks)
    prefill_s: float = 0.0  # the prefill forwards its prompt chunks ran in, up to its first token
    first_token_s: float = 0.0  # taken → its first token was picked
    total_s: float = 0.0  # taken → its last token was picked
    head_queue_s: float = 0.0  # on the head, before it was sent to a worker (the head sets it; 0 in process)
