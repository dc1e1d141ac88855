"""TeaCache's settings: the serving-side config and one request's resolved settings (threshold,
coefficients, warm-up and cool-down, the cap on skips, the residual forecast), checked without
weights so the head can validate a request before it is queued (``resolve_settings``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from triptych.accel.teacache_profile import (
    AUTO_THRESHOLD,
    ProfileIndex,
    TeaCacheProfile,
    calibrate_command,
    check_coefficients,
)
from triptych.core.errors import InvalidParam


@dataclass(frozen=True)
class TeaCacheConfig:
    """Serving-side TeaCache settings (per loaded model). See https://arxiv.org/abs/2411.19108."""

    warmup_steps: int | None = None
    """First steps of a request that always compute; None = the profile's ``warmup`` (explicit
    coefficients: 1)."""
    cooldown_steps: int | None = None
    """Last steps of a request that always compute; None = the profile's ``cooldown`` (explicit: 1)."""
    max_threshold: float = 2.0
    """Largest accepted ``teacache_threshold``; above it a request is refused."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "cooldown_steps"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"TeaCacheConfig.{name}={v}: must be >= 0 or None (use the profile's)")
        if not self.max_threshold > 0:
            raise ValueError(f"TeaCacheConfig.max_threshold={self.max_threshold}: must be > 0")


@dataclass(frozen=True)
class RequestSettings:
    """One request's resolved TeaCache settings (fixed at admission)."""

    threshold: float
    num_steps: int
    coefficients: tuple[float, ...]
    warmup: int
    cooldown: int
    profile: str | None  # profile path, or None for explicit coefficients
    max_skips: int | None = None  # cap on consecutive skips of one row; None = no cap
    forecast: int = 0  # skipped row's residual: 0 = last computed, 1 = linear from the last two (profile's)


def resolve_settings(
    family: str,
    profiles: Callable[[int], TeaCacheProfile | None],
    config: TeaCacheConfig,
    threshold: float,
    steps: int,
    coefficients: Sequence[float] | None = None,
) -> RequestSettings:
    """Check a request's TeaCache parameters; raises ``InvalidParam`` (HTTP 400) when unusable.

    Needs no weights, so the head validates with it before a request is queued. ``AUTO_THRESHOLD``
    becomes the profile's ``recommended_threshold``.
    """
    if threshold == AUTO_THRESHOLD:
        return _resolve_auto(family, profiles, config, steps)
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold)) or not (
        0 < threshold <= config.max_threshold
    ):
        raise InvalidParam("teacache_threshold", threshold, f"must be 0 (off) or in (0, {config.max_threshold}]")
    profile = None
    if coefficients is not None:
        try:
            coeffs = check_coefficients(coefficients, "teacache coefficients")
        except (TypeError, ValueError) as e:
            raise InvalidParam("teacache_coefficients", coefficients, str(e)) from e
    else:
        profile = profiles(steps)
        if profile is None:
            raise InvalidParam(
                "teacache_threshold",
                threshold,
                f"TeaCache is not calibrated for family {family!r} at {steps} steps: no profile "
                f"found; make one with `{_command(profiles, steps)}`, set threshold 0, or pass coefficients",
            )
        coeffs = profile.coefficients
    warmup = config.warmup_steps if config.warmup_steps is not None else (profile.warmup if profile else 1)
    cooldown = config.cooldown_steps
    if cooldown is None:
        cooldown = profile.cooldown if profile else 1
    max_skips = profile.max_skips if profile else None
    forecast = profile.forecast if profile else 0
    return RequestSettings(
        float(threshold), steps, coeffs, warmup, cooldown, profile.path if profile else None, max_skips, forecast
    )


def _resolve_auto(family: str, profiles, config: TeaCacheConfig, steps: int) -> RequestSettings:
    profile = profiles(steps)
    recommended = profile.recommended_threshold if profile is not None else None
    if recommended is None:
        where = "no profile found" if profile is None else f"profile {profile.path} has no recommended threshold"
        fix = "make one with" if profile is None else "calibrate again (another target or grid) with"
        raise InvalidParam(
            "teacache_threshold",
            "auto",
            f"needs a recommended threshold for family {family!r} at {steps} steps ({where}); "
            f"{fix} `{_command(profiles, steps)}`, or give a number",
        )
    return resolve_settings(family, profiles, config, min(recommended, config.max_threshold), steps)


def _command(profiles, steps: int) -> str:
    """The calibration that makes the missing profile: the model's own (``ProfileIndex``), else the
    generic line."""
    return profiles.command(steps) if isinstance(profiles, ProfileIndex) else calibrate_command(None, steps)
