"""Which requests run in the next step.

Order (ageing priority): every running request remembers the tick at which it last advanced (its
arrival tick before its first step), and its key is ``last_tick + priority * A`` with
A = ``EngineConfig.priority_age_ticks``: a virtual deadline, earliest first (then arrival). A
request of a more urgent class (``GenerationParams.priority``, lower sooner) therefore orders
ahead of those of a less urgent one that waited less than A ticks per class of difference; one
that waited longer goes first. Each tick the engine takes the request with the earliest key, runs
its compatibility group (family, size, frames, dtype), and fills the batch from that group in key
order, up to ``max_batch_requests`` and ``max_batch_tokens``; with ``lower_class_places`` set,
at most that many of its places go to requests of a class less urgent than the batch's most
urgent (those are preempted: ``DenoiserEngine`` parks them while they wait).

Bounds. Inside one class the key is the tick of the last step, least recently served first: with
B = ``max_batch_requests`` and the running requests in compatibility groups of sizes n_1 .. n_G, a
request waits at most ``sum(ceil(n_g / B)) - 1`` ticks between two of its steps (one group:
``ceil(R / B) - 1``; never more than R - 1), whatever its kind: a long video request cannot starve
short image requests, and image requests cannot starve the video. (Within the token budget; a batch
cut short by ``max_batch_tokens`` or ``lower_class_places`` adds ticks.) Across classes (ageing):
a request of class p, with q the most urgent class that runs while it waits and R the requests in
the engine, waits at most ``(p - q) * A + R - 1`` ticks between two of its steps, however long a
stream of more urgent requests keeps arriving: once it has waited ``(p - q) * A`` ticks every
request that steps or arrives gets a later key than its own, so each tick runs one of the at most
R - 1 requests whose key is still earlier, or it. (Requests that join later with a class more
urgent than q lower q.) A request is never parked or left waiting forever.
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
    parked: bool = False  # its state is parked (``engine.parking``) until its next step


def order_key(r: Running, config: EngineConfig) -> tuple[int, int]:
    """``r``'s place in the order: its virtual deadline (see the module docstring), then arrival."""
    return (r.last_tick + r.priority * config.priority_age_ticks, r.arrival)


def pick_batch(running: Sequence[Running], config: EngineConfig) -> list[Running]:
    """The batch for the next tick; empty when nothing runs."""
    if not running:
        return []
    order = sorted(running, key=lambda r: order_key(r, config))
    key = order[0].key
    group = [r for r in order if r.key == key]
    top = min(r.priority for r in group)
    lower_places = config.max_batch_requests if config.lower_class_places is None else config.lower_class_places
    batch: list[Running] = []
    tokens = 0
    for r in group:
        lower = r.priority > top
        if lower and lower_places <= 0 and batch:
            continue
        rows = len(r.state.cond.branches)
        cost = r.tokens * rows
        if batch and (len(batch) >= config.max_batch_requests or tokens + cost > config.max_batch_tokens):
            break
        batch.append(r)
        tokens += cost
        lower_places -= lower
    return batch


def displaced(running: Sequence[Running], batch: Sequence[Running], config: EngineConfig) -> list[Running]:
    """The requests more urgent ones displaced from ``batch``: those of the batch the less urgent
    requests of ``running`` would have had alone that are not in it (a request waiting its turn in
    its own class is not among them). ``DenoiserEngine.preempt`` parks these."""
    if not batch:
        return []
    top = min(r.priority for r in batch)
    lower = [r for r in running if r.priority > top]
    if not lower:
        return []
    chosen = {id(r) for r in batch}
    return [r for r in pick_batch(lower, config) if id(r) not in chosen]


TokenFn = Callable[[DenoiseState], int]
