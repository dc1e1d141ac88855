"""LoRA affinity on the head: route a request to a denoiser that already holds its adapters.

Each denoiser keeps its own adapters in memory (``triptych.lora.store``) and reports their names in
its stats report (``EngineStats.lora_resident``, read as ``Instance.loras``). A request naming
adapters goes preferably to a free, non-draining denoiser holding the most of them (ties: the one
with more free slots, then the pool's order), saving a load from disk and room in another's budget;
when none holds any, or every holder is busy, draining or failed this request, the role's dispatch
policy chooses as usual. A report lags by up to a heartbeat interval: a stale one costs a miss (the
denoiser loads the adapter), never a wrong image.
"""

from __future__ import annotations

from collections.abc import Sequence

from triptych.control.dispatch import Instance


def prefer_holder(names: Sequence[str], pool: list[Instance], exclude=frozenset()) -> Instance | None:
    """The free instance of ``pool`` holding the most of the adapters ``names``, or None."""
    want = set(names)
    best, best_key = None, (0, 0)
    for inst in pool:
        if inst.free <= 0 or inst.draining or inst.instance_id in exclude:
            continue
        key = (len(want.intersection(inst.loras)), inst.free)
        if key[0] and key > best_key:
            best, best_key = inst, key
    return best
