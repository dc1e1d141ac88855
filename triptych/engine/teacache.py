"""TeaCache for a loaded family: the engine's cache.

The denoiser engine owns one ``TeaCache`` per loaded family (``make_teacache``); the head, which
loads no weights, validates a request's ``teacache_threshold`` before queueing it with
``triptych.families.teacache_check.check_teacache``. ``make_teacache`` is::

    TeaCache(family.teacache_plan(), ProfileIndex(family.model_dir, family.name, profiles_dir), config)

with ``TeaCache`` from ``triptych.accel.teacache`` and ``ProfileIndex`` from
``triptych.accel.teacache_profile``. Calibration (``triptych.calibration``) takes the plan from the
family the same way; the server never imports calibration.
"""

from __future__ import annotations

from pathlib import Path

from triptych.accel.teacache import TeaCache
from triptych.accel.teacache_profile import ProfileIndex
from triptych.accel.teacache_settings import TeaCacheConfig
from triptych.families.base import Family
from triptych.families.teacache_check import has_plan


def make_teacache(
    family: Family, profiles_dir: str | Path | None = None, config: TeaCacheConfig | None = None, ranks=None
) -> TeaCache | None:
    """The family's TeaCache, or None when the family has no TeaCache plan or this instance loaded
    no transformer (it denoises nothing). ``ranks``: the instance's ``RankComposition`` on a
    multi-rank denoiser (``Parallelism.for_cache()``)."""
    if not has_plan(family) or getattr(family.pipe, "transformer", None) is None:
        return None
    profiles = ProfileIndex(family.model_dir, family.name, profiles_dir)
    return TeaCache(family.teacache_plan(), profiles, config, ranks, lora_plan=family.lora_plan)
