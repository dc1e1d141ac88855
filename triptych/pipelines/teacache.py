"""Which families have a TeaCache plan (``triptych.cache.teacache``), and the lookup for a loaded family.

The denoiser engine builds its cache with::

    from triptych.cache.teacache import TeaCache
    from triptych.cache.teacache_profile import ProfileIndex
    from triptych.pipelines.teacache import plan_for

    tc = TeaCache(plan_for(family), ProfileIndex(family.model_dir, family.name, profiles_dir), config)

Calibration (``triptych.calibration``) uses the same lookup; the server never imports calibration.
"""

from __future__ import annotations

import importlib

from triptych.cache.teacache import TeaCachePlan

# Family.name → "module:function(family) -> TeaCachePlan". A family without an entry has no TeaCache.
PLANS: dict[str, str] = {
    "flux": "triptych.pipelines.flux.teacache:plan_for",
    "qwen-image": "triptych.pipelines.qwenimage.teacache:plan_for",
    "qwen-image-edit": "triptych.pipelines.qwenimage.teacache:plan_for",
    "wan-t2v": "triptych.pipelines.wan.teacache:plan_for",
    "wan-i2v": "triptych.pipelines.wan.teacache:plan_for",
}


def has_plan(family) -> bool:
    return family.name in PLANS


def plan_for(family) -> TeaCachePlan:
    if family.name not in PLANS:
        raise ValueError(f"family {family.name!r} has no TeaCache plan; families with one: {sorted(PLANS)}")
    module, name = PLANS[family.name].split(":")
    return getattr(importlib.import_module(module), name)(family)
