"""Worker stats on the head: consecutive cumulative ``StatsReport``s → one ``StatsWindow`` of deltas.

Workers report cumulative counters (a lost report loses nothing: the next one carries it); the head
keeps the last report per instance and hands the difference to its consumers (``metrics``). A
report whose ``uptime_s`` went backwards comes from a restarted worker that reused the instance id:
its counters restarted at zero, so the whole report is the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from triptych.chat.stats import ChatEngineStats
from triptych.control import protocol as P
from triptych.core.kinds import Role
from triptych.engine.stats import EngineStats
from triptych.mmcache.stats import MMCacheStats
from triptych.plan.compute_stats import ComputeStats
from triptych.transfer.stats import TransferStats


@dataclass(frozen=True)
class StatsWindow:
    """What one worker did between two of its reports."""

    instance_id: str
    role: Role
    seconds: float  # worker-clock length of the window (0 for the first report of a worker)
    engine: EngineStats | None  # engine counter deltas; None for roles without an engine
    transfer: TransferStats  # transfer counter deltas
    mm_cache: MMCacheStats | None = None  # mm-hash cache counter deltas (entries, nbytes: latest)
    chat: ChatEngineStats | None = None  # chat engine counter deltas (prefix entries, bytes: latest)
    compute: ComputeStats | None = None  # model FLOPs executed in the window (model, peak: latest)


def stats_window(role: Role, prev: P.StatsReport | None, cur: P.StatsReport) -> StatsWindow:
    """The deltas from ``prev`` (None: nothing seen yet from this worker) to ``cur``."""
    if prev is None or cur.uptime_s < prev.uptime_s:
        seconds = 0.0 if prev is None else cur.uptime_s
        return StatsWindow(
            cur.instance_id, role, seconds, cur.engine, cur.transfer, cur.mm_cache, cur.chat, cur.compute
        )
    engine = cur.engine if prev.engine is None or cur.engine is None else cur.engine.since(prev.engine)
    cache = cur.mm_cache if prev.mm_cache is None or cur.mm_cache is None else cur.mm_cache.since(prev.mm_cache)
    chat = cur.chat if prev.chat is None or cur.chat is None else cur.chat.since(prev.chat)
    compute = cur.compute
    if compute is not None and prev.compute is not None:
        compute = msgspec.structs.replace(compute, flops=compute.flops - prev.compute.flops)
    transfer = cur.transfer.since(prev.transfer)
    return StatsWindow(cur.instance_id, role, cur.uptime_s - prev.uptime_s, engine, transfer, cache, chat, compute)
