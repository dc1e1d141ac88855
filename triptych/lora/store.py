"""The denoiser's adapters in memory, under a byte budget.

Ownership contract (like the mm-hash cache's): ``acquire(request_id, names)`` loads what is missing
(a miss; a loaded one is a hit) and references each adapter by that request; ``release(request_id)``
drops its references. An adapter referenced by a running request is never evicted. Unreferenced
adapters stay loaded in least-recently-used order and are evicted only when a load needs room. A
load that cannot fit beside the referenced adapters raises ``LoraBudgetError`` and loads nothing
(the request fails; nothing already running is touched). Every load is handed to ``on_load`` (the
``RowLora`` hooks its layers), so the hooks always know an adapter before a row uses it.

The LRU is hand-written, as the mm-hash store's (``mmcache/store.py`` says why ``cachetools`` does not
fit): referenced adapters are skipped, and a load that cannot fit evicts nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from triptych.core.errors import TriptychError
from triptych.lora.adapter import Adapter

logger = logging.getLogger(__name__)


class LoraBudgetError(TriptychError):
    """The adapters of running requests leave no room for this one."""


class LoraStats(msgspec.Struct):
    """Cumulative adapter-store counters (sent in the denoiser's stats report)."""

    loaded: int = 0  # adapters read into memory
    evicted: int = 0  # adapters dropped to make room
    hits: int = 0  # acquires that found the adapter in memory
    misses: int = 0  # acquires that had to load it
    mixed_batches: int = 0  # forwards whose rows used more than one adapter setting (none counts as one)
    resident_bytes: int = 0  # bytes of the adapters in memory now (a gauge)


@dataclass
class _Entry:
    adapter: Adapter
    users: set[str]


class AdapterStore:
    def __init__(
        self,
        budget_bytes: int,
        load: Callable[[str], Adapter],
        on_load: Callable[[Adapter], None] = lambda a: None,
    ):
        """``load(name)`` reads a known adapter (raises for an unknown one)."""
        self.budget_bytes = budget_bytes
        self._load = load
        self._on_load = on_load
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU order: oldest first
        self._held: dict[str, tuple[str, ...]] = {}
        self.stats = LoraStats()

    def loaded(self) -> list[str]:
        return list(self._entries)

    def in_use(self) -> bool:
        """Whether any running request holds an adapter (so room may come free)."""
        return any(self._held.values())

    def get(self, name: str) -> Adapter:
        """An adapter acquired by a running request (asserts it is loaded)."""
        return self._entries[name].adapter

    def acquire(self, request_id: str, names: Sequence[str]) -> list[Adapter]:
        assert request_id not in self._held, f"request {request_id!r} already holds adapters"
        out = []
        try:
            for name in names:
                out.append(self._acquire_one(request_id, name))
        except Exception:
            self._held[request_id] = tuple(names)
            self.release(request_id)
            raise
        self._held[request_id] = tuple(names)
        return out

    def release(self, request_id: str) -> None:
        for name in self._held.pop(request_id, ()):
            entry = self._entries.get(name)
            if entry is not None:
                entry.users.discard(request_id)

    def _acquire_one(self, request_id: str, name: str) -> Adapter:
        entry = self._entries.get(name)
        if entry is not None:
            self.stats.hits += 1
            self._entries.move_to_end(name)
        else:
            self.stats.misses += 1
            adapter = self._load(name)
            self._make_room(adapter)
            self._on_load(adapter)
            entry = self._entries[name] = _Entry(adapter, set())
            self.stats.loaded += 1
            self.stats.resident_bytes += adapter.nbytes
            logger.info("loaded LoRA %r (%d bytes, rank %d)", name, adapter.nbytes, adapter.rank)
        entry.users.add(request_id)
        return entry.adapter

    def _make_room(self, adapter: Adapter) -> None:
        need = adapter.nbytes
        free = self.budget_bytes - self.stats.resident_bytes
        idle = [n for n, e in self._entries.items() if not e.users]
        idle_bytes = sum(self._entries[n].adapter.nbytes for n in idle)
        if need > free + idle_bytes:
            raise LoraBudgetError(
                f"LoRA {adapter.name!r} needs {need} bytes; the budget is {self.budget_bytes} with "
                f"{self.budget_bytes - free - idle_bytes} held by running requests"
            )
        for name in idle:
            if need <= free:
                break
            gone = self._entries.pop(name)
            free += gone.adapter.nbytes
            self.stats.resident_bytes -= gone.adapter.nbytes
            self.stats.evicted += 1
            logger.info("evicted LoRA %r", name)
