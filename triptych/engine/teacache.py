"""TeaCache for a loaded family: which families have a plan, the engine's cache and the head's check.

The denoiser engine owns one ``TeaCache`` per loaded family (``make_teacache``); the head, which
loads no weights, validates a request's ``teacache_threshold`` with ``check_teacache`` before
queueing it, so a request the engine would refuse is a 400 at the door, not a failed stage.
``make_teacache`` is::

    TeaCache(plan_for(family), ProfileIndex(family.model_dir, family.name, profiles_dir), config)

with ``TeaCache`` from ``triptych.accel.teacache`` and ``ProfileIndex`` from
``triptych.accel.teacache_profile``. Calibration (``triptych.calibration``) uses the same lookup; the
server never imports calibration.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from triptych.accel.teacache import TeaCache, TeaCachePlan
from triptych.accel.teacache_profile import ProfileIndex
from triptych.accel.teacache_settings import TeaCacheConfig, resolve_settings
from triptych.core.errors import InvalidParam
from triptych.families.base import Family, GenerationParams

# Family.name → "module:function(family) -> TeaCachePlan". A family without an entry has no TeaCache.
PLANS: dict[str, str] = {
    "flux": "triptych.families.flux.teacache:plan_for",
    "qwen-image": "triptych.families.qwenimage.teacache:plan_for",
    "qwen-image-edit": "triptych.families.qwenimage.teacache:plan_for",
    "wan-t2v": "triptych.families.wan.teacache:plan_for",
    "wan-i2v": "triptych.families.wan.teacache:plan_for",
}


def has_plan(family) -> bool:
    return family.name in PLANS


def plan_for(family) -> TeaCachePlan:
    if family.name not in PLANS:
        raise ValueError(f"family {family.name!r} has no TeaCache plan; families with one: {sorted(PLANS)}")
    module, name = PLANS[family.name].split(":")
    return getattr(importlib.import_module(module), name)(family)


def make_teacache(
    family: Family, profiles_dir: str | Path | None = None, config: TeaCacheConfig | None = None, ranks=None
) -> TeaCache | None:
    """The family's TeaCache, or None when the family has no TeaCache plan. ``ranks``: the instance's
    ``RankComposition`` on a multi-rank denoiser (``Parallelism.for_cache()``)."""
    if not has_plan(family):
        return None
    profiles = ProfileIndex(family.model_dir, family.name, profiles_dir)
    return TeaCache(plan_for(family), profiles, config, ranks, lora_plan=family.lora_plan)


def check_teacache(
    family: Family,
    params: GenerationParams,
    profiles_dir: str | Path | None = None,
    config: TeaCacheConfig | None = None,
) -> None:
    """Raise ``InvalidParam`` if ``params`` asks for TeaCache this model cannot run."""
    threshold = params.teacache_threshold
    if threshold == 0:
        return
    if not has_plan(family):
        raise InvalidParam(
            "teacache_threshold",
            threshold,
            f"TeaCache is not available for family {family.name!r} (available for: {', '.join(sorted(PLANS))}); use 0",
        )
    profiles = ProfileIndex(family.model_dir, family.name, profiles_dir)
    resolve_settings(family.name, profiles, config or TeaCacheConfig(), threshold, params.steps)
