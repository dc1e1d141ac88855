"""Which requests run in the next step.

Priority first: a request's class (``GenerationParams.priority``, lower sooner) orders before
everything below, so when the batch is full a higher-priority request that just joined takes a
place at the next step boundary ahead of lower ones (which keep their state and wait; nothing is
parked or swapped out). The bound below holds inside one class (with requests of a single class,
as when no request names a priority).

Fairness policy (least recently served first): every running request remembers the tick at which
it last advanced (its arrival tick before its first step). Each tick the engine picks the request
that has waited longest, runs its compatibility group (family, size, frames, dtype), and fills the
batch from that group in the same waited-longest order, up to ``max_batch_requests`` and
``max_batch_tokens``. With B = ``max_batch_requests`` and the running requests in compatibility
groups of sizes n_1 .. n_G, a request therefore waits at most ``sum(ceil(n_g / B)) - 1`` ticks
between two of its steps (one group: ``ceil(R / B) - 1``; never more than R - 1), whatever its
kind: a long video request cannot starve short image requests, and image requests cannot starve
the video. (Within the token budget; a batch cut short by ``max_batch_tokens`` adds ticks.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from triptych.engine.config import EngineConfig
from triptych.families.base import DenoiseState


@dataclass
class Running:
    """A request in the engine, with its scheduling bookkeeping."""

    state: DenoiseState
    key: tuple
    tokens: int  # latent sequence length of one row
    last_tick: int  # tick of the last step (arrival tick before the first)
    arrival: int  # monotonic arrival counter: tie-breaker
    priority: int = 0  # its class (``GenerationParams.priority``): lower runs sooner


def pick_batch(running: Sequence[Running], config: EngineConfig) -> list[Running]:
    """The batch for the next tick; empty when nothing runs."""
    if not running:
        return []
    order = sorted(running, key=lambda r: (r.priority, r.last_tick, r.arrival))
    key = order[0].key
    batch: list[Running] = []
    tokens = 0
    for r in order:
        if r.key != key:
            continue
        rows = len(r.state.cond.branches)
        cost = r.tokens * rows
        if batch and (len(batch) >= config.max_batch_requests or tokens + cost > config.max_batch_tokens):
            break
        batch.append(r)
        tokens += cost
    return batch


TokenFn = Callable[[DenoiseState], int]
