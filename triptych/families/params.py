"""``GenerationParams``: what one generation request asks for. No torch here, so a command line builds
its flags from it before torch is imported (``triptych generate``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerationParams:
    """One request's user-facing parameters, after ``Family.resolve`` filled defaults and checked rules.

    ``guidance`` is the family's guidance: the true-CFG scale for Qwen-Image and Wan (CFG runs when it
    is > 1), the distilled guidance for FLUX.
    """

    prompt: str
    """What to generate."""
    negative_prompt: str | None = None
    """What to steer away from (with CFG); None: no negative prompt."""
    height: int | None = None
    """Output height in pixels; None: the model's default."""
    width: int | None = None
    """Output width in pixels; None: the model's default."""
    frames: int | None = None
    """Video families: number of frames (images are one frame); None: the model's default."""
    steps: int | None = None
    """Denoising steps; None: the model's default."""
    guidance: float | None = None
    """True-CFG scale (Qwen-Image, Wan) or distilled guidance (FLUX); None: the model's default."""
    seed: int = 0
    """Seed of the initial noise: the same seed and settings give the same bytes."""
    image: Any = None
    """PIL.Image condition image (edit / image-to-video), None for text-only."""
    true_cfg: float = 1.0
    """FLUX only: true CFG scale with the negative prompt when > 1 (Qwen-Image and Wan use guidance)."""
    teacache_threshold: float = 0.0
    """TeaCache threshold (0 = off) or auto (the profile's recommendation); needs a calibration
    profile (triptych calibrate; see triptych.accel.teacache)."""
    tenant: str = ""
    """Who asked (a hash of the API key at the head); scopes the mm-hash cache."""
    lora: tuple[tuple[str, float], ...] = ()
    """LoRA adapters applied to this request's rows, in order: ``((name, scale), ...)``; () = none."""
    lora_paths: tuple[tuple[str, str], ...] = ()
    """Weight files of its adapters loaded at run time (``POST /v1/loras``): ``((name, path), ...)``."""
    priority: int = 0
    """Its priority class: lower runs sooner (vLLM's convention), in the head's queues and in the
    denoiser engine's batches; first come, first served inside a class."""

    def replace(self, **changes: Any) -> GenerationParams:
        return dataclasses.replace(self, **changes)
