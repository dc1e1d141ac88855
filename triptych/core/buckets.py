"""Fixed histogram buckets counted where the observations happen (a worker), so the head's
histograms get every real observation's bucket, not a report window's mean (``control.metrics_hist``).

Counts are per bucket, not cumulative: ``counts[i]`` observations fell in ``(bounds[i-1], bounds[i]]``
and the last slot holds those above every bound (Prometheus' ``+Inf``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

#: Upper bounds (seconds) of the step-time buckets a denoiser engine counts each tick in.
STEP_SECONDS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Upper bounds (seconds) of the push-latency buckets a transfer sender counts each push in.
PUSH_SECONDS_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
#: Upper bounds (seconds) of the chat latency buckets: a chat's stages and its time to first token.
CHAT_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: Upper bounds (seconds) of the gaps between a streamed chat's consecutive pieces.
INTER_TOKEN_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 10)


def observe(counts: list[int], bounds: Sequence[float], value: float) -> None:
    """Count ``value`` in its bucket; ``counts`` grows to ``len(bounds) + 1`` slots on first use."""
    if len(counts) < len(bounds) + 1:
        counts.extend([0] * (len(bounds) + 1 - len(counts)))
    counts[bisect_left(bounds, value)] += 1


def since(cur: Sequence[int], prev: Sequence[int]) -> list[int]:
    """The counts added from ``prev`` to ``cur`` (an absent slot counts zero)."""
    return [n - (prev[i] if i < len(prev) else 0) for i, n in enumerate(cur)]
