"""Instance bookkeeping on the head and the policies that pick an instance for a stage.

A registered instance has a fixed ``capacity`` (slots): the head charges one slot per request it
routes there from the moment it reserves the instance (before any upstream work starts) until the
request's tensors left it (or the request ended). A policy only ever picks an instance with a free
slot that is not draining; when none has one the request waits in its role's queue.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from triptych.core.kinds import Role, TransferKind

if TYPE_CHECKING:
    from triptych.control.protocol import StatsReport


@dataclass
class Instance:
    """One registered worker as the head sees it. Owned by the orchestrator's event loop."""

    instance_id: str
    role: Role
    capacity: int  # slots
    control: str  # ZMQ identity / address of its rank-0 control socket
    data: str  # transfer endpoint address
    transfer: TransferKind  # the transfer backend it runs
    pid: int
    last_seen: float  # monotonic time of the last message from it
    held: set[str] = field(default_factory=set)  # request ids holding one of its slots
    assigned: int = 0  # requests ever routed here (metrics, tests)
    report: dict = field(default_factory=dict)  # last heartbeat's load report
    stats: StatsReport | None = None  # last cumulative stats report (the base of the next window)
    chat: bool = False  # an encoder that answers chats (its text encoder is a VLM)
    chat_slots: int = 0  # chats it may hold apart from its slots (0: each chat takes a slot)
    chat_held: set[str] = field(default_factory=set)  # the chats among ``held``
    draining: bool = False  # being scaled in: no new request is routed here; it finishes what it holds

    @property
    def free(self) -> int:
        return self.capacity - len(self.held) + len(self.chat_held)

    @property
    def loras(self) -> list[str]:
        """The LoRA adapters this denoiser reported holding in memory (its last stats report)."""
        engine = self.stats.engine if self.stats is not None else None
        return list(engine.lora_resident) if engine is not None else []

    @property
    def chat_free(self) -> int:
        """Free chat slots (an instance without its own takes chats in its encode slots)."""
        return self.chat_slots - len(self.chat_held) if self.chat_slots else self.free

    def hold_chat(self, request_id: str) -> None:
        if not self.chat_slots:
            return self.hold(request_id)
        assert self.chat_free > 0 and request_id not in self.held, (self.instance_id, request_id)
        self.held.add(request_id)
        self.chat_held.add(request_id)
        self.assigned += 1

    def hold(self, request_id: str) -> None:
        assert self.free > 0 and request_id not in self.held, (self.instance_id, request_id)
        self.held.add(request_id)
        self.assigned += 1

    def unhold(self, request_id: str) -> bool:
        if request_id in self.held:
            self.held.discard(request_id)
            self.chat_held.discard(request_id)
            return True
        return False


class DispatchPolicy(ABC):
    """Chooses one instance of a role for a request; returns None when no candidate has a free slot."""

    name: str

    def pick(self, instances: Iterable[Instance], exclude: frozenset[str] = frozenset()) -> Instance | None:
        candidates = sorted(
            (i for i in instances if i.free > 0 and not i.draining and i.instance_id not in exclude),
            key=lambda i: i.instance_id,
        )
        return self._choose(candidates) if candidates else None

    @abstractmethod
    def _choose(self, candidates: Sequence[Instance]) -> Instance:
        """``candidates`` is non-empty, sorted by instance id, every one with a free slot."""


class RoundRobin(DispatchPolicy):
    """Cycle through instances in id order, skipping those without a free slot."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def _choose(self, candidates: Sequence[Instance]) -> Instance:
        chosen = next((i for i in candidates if self._last is None or i.instance_id > self._last), candidates[0])
        self._last = chosen.instance_id
        return chosen


class MaxFreeSlots(DispatchPolicy):
    """The instance with the most free slots; ties go round robin so equal instances share work."""

    name = "max_free_slots"

    def __init__(self) -> None:
        self._tiebreak = itertools.count()

    def _choose(self, candidates: Sequence[Instance]) -> Instance:
        best = max(i.free for i in candidates)
        tied = [i for i in candidates if i.free == best]
        return tied[next(self._tiebreak) % len(tied)]


class ChatSlots(DispatchPolicy):
    """Chat-capable encoders by free chat slots: the most free first, ties round robin."""

    name = "chat_slots"

    def __init__(self) -> None:
        self._tiebreak = itertools.count()

    def pick(self, instances: Iterable[Instance], exclude: frozenset[str] = frozenset()) -> Instance | None:
        candidates = sorted(
            (i for i in instances if i.chat and i.chat_free > 0 and not i.draining and i.instance_id not in exclude),
            key=lambda i: i.instance_id,
        )
        return self._choose(candidates) if candidates else None

    def _choose(self, candidates: Sequence[Instance]) -> Instance:
        best = max(i.chat_free for i in candidates)
        tied = [i for i in candidates if i.chat_free == best]
        return tied[next(self._tiebreak) % len(tied)]


POLICIES: dict[str, type[DispatchPolicy]] = {"round_robin": RoundRobin, "max_free_slots": MaxFreeSlots}


def make_policy(name: str) -> DispatchPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"dispatch policy {name!r} is not one of {sorted(POLICIES)}") from None
