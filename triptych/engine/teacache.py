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

from pathlib import Path

from triptych.accel.teacache import TeaCache, TeaCachePlan
from triptych.accel.teacache_profile import ProfileIndex
from triptych.accel.teacache_settings import TeaCacheConfig, resolve_settings
from triptych.core.errors import InvalidParam
from triptych.families.base import Family, GenerationParams
from triptych.families.registry import teacache_families, teacache_plan


def has_plan(family) -> bool:
    """Whether ``family`` has a TeaCache plan (its ``families.registry.FamilyEntry.teacache``)."""
    return teacache_plan(family.name) is not None


def plan_for(family) -> TeaCachePlan:
    plan = teacache_plan(family.name)
    if plan is None:
        raise ValueError(f"family {family.name!r} has no TeaCache plan; families with one: {teacache_families()}")
    return plan(family)


def make_teacache(
    family: Family, profiles_dir: str | Path | None = None, config: TeaCacheConfig | None = None, ranks=None
) -> TeaCache | None:
    """The family's TeaCache, or None when the family has no TeaCache plan or this instance loaded
    no transformer (it denoises nothing). ``ranks``: the instance's ``RankComposition`` on a
    multi-rank denoiser (``Parallelism.for_cache()``)."""
    if not has_plan(family) or getattr(family.pipe, "transformer", None) is None:
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
            f"TeaCache is not available for family {family.name!r} (available for: {', '.join(teacache_families())}); use 0",
        )
    profiles = ProfileIndex(family.model_dir, family.name, profiles_dir)
    resolve_settings(family.name, profiles, config or TeaCacheConfig(), threshold, params.steps)
