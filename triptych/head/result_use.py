"""Which requests use the head's result cache, and their keys (``result_cache``, ``result_key``).

A request is looked up, and its results stored, only when the cache is on
(``HeadConfig.result_cache_mb`` > 0), the request gives a ``seed`` (without one each request is a
fresh random draw, never a repeat) and it did not opt out (``result_cache: false``). Otherwise its
lookups count as ``bypassed``. Each image of an ``n`` > 1 request (seeds ``seed``, ``seed + 1``,
...) has its own key: any of them may be answered from the cache while the others run.
"""

from __future__ import annotations

from collections.abc import Sequence

from triptych.control.backend import GenerationJob
from triptych.core import offload
from triptych.head.result_key import ResultKeys
from triptych.head.state import ModelHead


async def cache_keys(model: ModelHead, req, jobs: Sequence[GenerationJob]) -> list[str] | None:
    """The result-cache key of each job of ``req``, or None when the request does not use the cache."""
    cache = model.results
    if not cache.enabled or req.seed is None or req.result_cache is False:
        cache.bypass(len(jobs))
        return None
    files = {name: info.file for name, info in model.served.lora.adapters.items()}
    root = model.config.teacache_profiles_root
    base = await offload.run(model.result_keys.base, model.model_id, model.family, jobs[0], files, root)
    return [ResultKeys.for_seed(base, job.params.seed) for job in jobs]


def lookup(model: ModelHead, keys: list[str] | None, count: int) -> list[bytes | None]:
    """The stored result of each key (None: run it); all None without keys."""
    return [model.results.get(k) for k in keys] if keys is not None else [None] * count


def store(model: ModelHead, key: str | None, data: bytes) -> None:
    """Keep a finished job's output under its key (nothing without one)."""
    if key is not None:
        model.results.put(key, data)
