"""Worker stats on the head: consecutive cumulative ``StatsReport``s → one ``StatsWindow`` of deltas.

Workers report cumulative counters (a lost report loses nothing: the next one carries it); the head
keeps the last report per instance and hands the difference to its consumers (``metrics``). A
report whose ``uptime_s`` went backwards comes from a restarted worker that reused the instance id:
its counters restarted at zero, so the whole report is the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from triptych.server import protocol as P


@dataclass(frozen=True)
class StatsWindow:
    """What one worker did between two of its reports."""

    instance_id: str
    role: str  # encoder | denoiser | decoder
    seconds: float  # worker-clock length of the window (0 for the first report of a worker)
    engine: P.EngineReport | None  # engine counter deltas; None for roles without an engine
    transfer: P.TransferReport  # transfer counter deltas
    mm_cache: P.CacheReport | None = None  # mm-hash cache counter deltas (entries, nbytes: latest)


LEVELS = frozenset({"entries", "nbytes"})  # fields that are levels, not counters: kept as reported


def _minus(cur, prev):
    """Field-wise ``cur - prev`` of two reports of the same struct type (counts and dicts of counts)."""
    out = {}
    for name in cur.__struct_fields__:
        a, b = getattr(cur, name), getattr(prev, name)
        if name in LEVELS:
            out[name] = a
        elif isinstance(a, dict):
            out[name] = {k: n - b.get(k, 0) for k, n in a.items() if n != b.get(k, 0)}
        elif isinstance(a, (int, float)):
            out[name] = a - b
        else:
            out[name] = a
    return type(cur)(**out)


def stats_window(role: str, prev: P.StatsReport | None, cur: P.StatsReport) -> StatsWindow:
    """The deltas from ``prev`` (None: nothing seen yet from this worker) to ``cur``."""
    if prev is None or cur.uptime_s < prev.uptime_s:
        seconds = 0.0 if prev is None else cur.uptime_s
        return StatsWindow(cur.instance_id, role, seconds, cur.engine, cur.transfer, cur.mm_cache)
    engine = cur.engine if prev.engine is None or cur.engine is None else _minus(cur.engine, prev.engine)
    cache = cur.mm_cache if prev.mm_cache is None or cur.mm_cache is None else _minus(cur.mm_cache, prev.mm_cache)
    transfer = _minus(cur.transfer, prev.transfer)
    return StatsWindow(cur.instance_id, role, cur.uptime_s - prev.uptime_s, engine, transfer, cache)
