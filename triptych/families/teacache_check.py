"""Whether a family has TeaCache, and whether a request's ``teacache_threshold`` can run on it, asked
without weights and without torch: the head refuses a request the engine would refuse with a 400 at the
door (``check_teacache``), not a failed stage. The engine's cache itself is ``triptych.engine.teacache``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from triptych.accel.teacache_profile import ProfileIndex
from triptych.accel.teacache_settings import TeaCacheConfig, resolve_settings
from triptych.core.errors import InvalidParam
from triptych.families.params import GenerationParams
from triptych.families.registry import has_teacache, teacache_families

if TYPE_CHECKING:  # the head passes its weightless adapter; the checks read its name and model directory
    from triptych.families.base import Family


def has_plan(family: Family) -> bool:
    """Whether ``family`` has a TeaCache plan (``Family.teacache_plan``), from its registry entry: no
    weights, no import of the family."""
    return has_teacache(family.name)


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
