"""Accelerations the engine attaches to a loaded family (today: TeaCache), and their head-side checks.

The engine owns one ``TeaCache`` per loaded family (``make_teacache``); the head, which loads no
weights, validates a request's ``teacache_threshold`` with ``check_teacache`` before queueing it,
so a request the engine would refuse is a 400 at the door, not a failed stage.
"""

from __future__ import annotations

from pathlib import Path

from triptych.cache.teacache import TeaCache, TeaCacheConfig, resolve_settings
from triptych.cache.teacache_profile import ProfileIndex
from triptych.errors import InvalidParam
from triptych.pipelines.base import Family, GenerationParams
from triptych.pipelines.teacache import PLANS, has_plan, plan_for


def make_teacache(family: Family, profiles_dir: str | Path | None = None, config: TeaCacheConfig | None = None):
    """The family's TeaCache, or None when the family has no TeaCache plan."""
    if not has_plan(family):
        return None
    return TeaCache(plan_for(family), ProfileIndex(family.model_dir, family.name, profiles_dir), config)


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
