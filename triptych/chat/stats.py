"""Counters of the chat engine and its prefix KV cache (``chat.engine``): plain msgspec
data, no torch (the head decodes them in stats reports)."""

from __future__ import annotations

import msgspec


class ChatEngineStats(msgspec.Struct, kw_only=True):
    """Cumulative counters and levels of one encoder's chat engine; sent to the head as they are
    inside a worker's stats report (``protocol.StatsReport.chat``)."""

    prefill_computed: int = 0  # prompt tokens run through the model at admission
    prefill_reused: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_forwards: int = 0  # batched prefill forwards (one per step with prefill work)
    decode_forwards: int = 0  # batched decode steps (one forward each, all running chats)
    decode_tokens: int = 0  # tokens those steps produced (sum of the batch sizes)
    prefix_evictions: int = 0
    prefix_entries: int = 0  # a level, not a counter: a window keeps the latest
    prefix_nbytes: int = 0  # a level, like prefix_entries
    prefill_rows: int = 0  # chat chunks the prefill forwards ran (sum of their batch sizes)
    max_batch: int = 0  # the most chats that ever decoded in one forward (a level: the latest)

    def since(self, prev: ChatEngineStats) -> ChatEngineStats:
        """The window from ``prev`` to this report: counter deltas, the levels as they are now."""
        fields = (
            "prefill_computed",
            "prefill_reused",
            "prefill_forwards",
            "prefill_rows",
            "decode_forwards",
            "decode_tokens",
        )
        delta = {f: getattr(self, f) - getattr(prev, f) for f in (*fields, "prefix_evictions")}
        levels = {f: getattr(self, f) for f in ("prefix_entries", "prefix_nbytes", "max_batch")}
        return ChatEngineStats(**delta, **levels)
