"""Receiver-side slot bookkeeping: which transfer holds which slot, for how long.

Pure bookkeeping: no sockets, no buffers, no clock reads, no locks. The endpoint that owns a pool
serializes calls to it and maps slots to buffers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cachetools import FIFOCache

from triptych.transfer.errors import DuplicateTransfer, SlotUnavailable, UnknownTransfer


class SlotState(enum.Enum):
    RESERVED = "reserved"  # slot held, waiting for the sender's push
    READY = "ready"  # bytes arrived, waiting for the receiver to take them


@dataclass
class Slot:
    """One live reservation."""

    slot: int  # index in [0, max_slots)
    transfer_id: str  # unique key of the transfer
    nbytes: int  # bytes charged against the pool's byte capacity
    peer: str  # instance id of the only sender allowed to fill it
    deadline: float  # monotonic time after which `expire` releases it
    state: SlotState = SlotState.RESERVED


class SlotPool:
    """Slots of one receiver, bounded both in count and in bytes.

    Ownership contract:
      * `reserve` hands a slot to `transfer_id`; from then on the receiver owns the slot and the
        bytes it is charged, until exactly one of `release`, `expire` or `reclaim_peer` returns it.
      * A slot moves RESERVED -> READY (`mark_ready`, once) -> released. Any other transition
        raises. Released slots are forgotten; their buffers are the caller's to free, and the
        returned `Slot` records say which.
      * A transfer id is unique: reserving an id that is live, or among the last
        `remember_finished` released ids, raises `DuplicateTransfer` (so a late or replayed push
        can never fill a new slot under an old id).
      * Deadlines are compared against the `now` the caller passes in; READY slots expire too (a
        receiver that never takes its tensor does not pin memory forever).
    Not thread-safe: the owning endpoint holds its own lock around every call.
    """

    def __init__(self, max_slots: int, max_bytes: int, remember_finished: int = 1024) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots} must be >= 1")
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        if remember_finished < 1:
            raise ValueError(f"remember_finished={remember_finished} must be >= 1")
        self._free: list[int] = list(range(max_slots - 1, -1, -1))  # pop() gives the lowest index
        self._live: dict[str, Slot] = {}
        self._finished: FIFOCache[str, None] = FIFOCache(remember_finished)  # released ids, the oldest forgotten
        self._used_bytes = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self._used_bytes

    @property
    def in_use(self) -> int:
        return len(self._live)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def is_full_capacity(self) -> bool:
        """True when nothing is reserved: every slot and byte is free."""
        return not self._live and self._used_bytes == 0 and len(self._free) == self.max_slots

    def get(self, transfer_id: str) -> Slot | None:
        return self._live.get(transfer_id)

    def live(self) -> list[Slot]:
        return list(self._live.values())

    def finished(self, transfer_id: str) -> bool:
        """True when `transfer_id` held a slot that is released now (among the remembered ones)."""
        return transfer_id in self._finished

    # -- transitions --------------------------------------------------------------------------
    def reserve(self, transfer_id: str, nbytes: int, peer: str, deadline: float) -> int:
        """Hold a slot of `nbytes` for `transfer_id`, fillable only by `peer`, until `deadline`."""
        if transfer_id in self._live or transfer_id in self._finished:
            raise DuplicateTransfer(f"transfer id {transfer_id!r} is already in use or was used")
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if nbytes > self.max_bytes:
            raise SlotUnavailable(f"transfer {transfer_id!r} needs {nbytes} bytes > pool capacity {self.max_bytes}")
        if not self._free:
            raise SlotUnavailable(f"no free slot for {transfer_id!r} ({self.max_slots} in use)")
        if nbytes > self.free_bytes:
            raise SlotUnavailable(f"transfer {transfer_id!r} needs {nbytes} bytes, {self.free_bytes} free")
        index = self._free.pop()
        self._live[transfer_id] = Slot(index, transfer_id, nbytes, peer, deadline)
        self._used_bytes += nbytes
        return index

    def mark_ready(self, transfer_id: str) -> Slot:
        """RESERVED -> READY; raises `UnknownTransfer` or `DuplicateTransfer` (already filled)."""
        slot = self._require(transfer_id)
        if slot.state is not SlotState.RESERVED:
            raise DuplicateTransfer(f"transfer {transfer_id!r} is already {slot.state.value}")
        slot.state = SlotState.READY
        return slot

    def release(self, transfer_id: str) -> Slot | None:
        """Return the slot to the pool; None if the id holds no slot (idempotent)."""
        slot = self._live.pop(transfer_id, None)
        if slot is None:
            return None
        self._used_bytes -= slot.nbytes
        self._free.append(slot.slot)
        self._free.sort(reverse=True)
        self._finished[transfer_id] = None
        return slot

    def expire(self, now: float) -> list[Slot]:
        """Release and return every slot whose deadline is <= `now`."""
        due = [s.transfer_id for s in self._live.values() if s.deadline <= now]
        return [s for s in map(self.release, due) if s is not None]

    def reclaim_peer(self, peer: str) -> list[Slot]:
        """Release and return every slot reserved for `peer` (declared dead)."""
        owned = [s.transfer_id for s in self._live.values() if s.peer == peer]
        return [s for s in map(self.release, owned) if s is not None]

    def _require(self, transfer_id: str) -> Slot:
        slot = self._live.get(transfer_id)
        if slot is None:
            raise UnknownTransfer(f"transfer id {transfer_id!r} holds no slot")
        return slot
