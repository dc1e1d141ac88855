"""The values that cross the stage boundaries (``families.base``): what a request asks for
(``GenerationParams``), what encode hands on (``Conditioning``), a request's denoising state
(``DenoiseState``), the rows of a batched forward (``Row``, ``StepStats``) and decoded ``Frames``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from triptych.core.kinds import Role
from triptych.families.params import GenerationParams as GenerationParams

COND = "cond"
UNCOND = "uncond"
BRANCH_ORDER = (COND, UNCOND)


ALL_ROLES = frozenset(Role)


@dataclass
class Conditioning:
    """Encoder output for one request. Owns its tensors (no views into batch buffers).

    ``branches`` maps a CFG branch name (``cond``/``uncond``) to that branch's model inputs;
    ``shared`` holds branch-independent tensors (e.g. image latents for edit / image-to-video).
    """

    branches: dict[str, dict[str, torch.Tensor]]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> Conditioning:
        """The same conditioning with every tensor on ``device`` (no copy for those already there)."""
        branches, shared = tree_map(lambda t: t.to(device), (self.branches, self.shared))
        return Conditioning(branches=branches, shared=shared)

    def flat(self) -> dict[str, torch.Tensor]:
        """Flatten to ``"<branch>.<name>"`` keys for transport; ``from_flat`` inverts it."""
        out = {f"{b}.{k}": v for b, d in self.branches.items() for k, v in d.items()}
        out.update({f"shared.{k}": v for k, v in self.shared.items()})
        return out

    @classmethod
    def from_flat(cls, flat: dict[str, torch.Tensor]) -> Conditioning:
        branches: dict[str, dict[str, torch.Tensor]] = {}
        shared: dict[str, torch.Tensor] = {}
        for key, tensor in flat.items():
            scope, name = key.split(".", 1)
            (shared if scope == "shared" else branches.setdefault(scope, {}))[name] = tensor
        return cls(branches=branches, shared=shared)


@dataclass
class DenoiseState:
    """Per-request denoising state; owned by exactly one denoiser instance at a time.

    The scheduler is this request's own instance (multistep schedulers keep history), so requests
    at different steps, with different step counts, can share a batch.
    """

    request_id: str
    params: GenerationParams
    latents: torch.Tensor  # batch dim 1, the family's packed layout
    scheduler: Any  # a diffusers scheduler instance owned by this request
    timesteps: torch.Tensor  # (steps,)
    cond: Conditioning
    aux: dict[str, torch.Tensor] = field(default_factory=dict)  # family-specific per-request tensors
    step: int = 0
    #: steps (1-based counts of steps done) after which a preview of the predicted clean latents is
    #: kept in ``x0``; empty = none. Previews read the step's prediction and never change ``latents``.
    preview_steps: frozenset[int] = frozenset()
    x0: torch.Tensor | None = None  # the last preview's predicted clean latents, until its owner takes it
    #: what the family computed once at ``prepare`` for every step (RoPE, text input, timestep and
    #: modulation tables: ``pipelines/<family>/fast.py``); None = the step computes them. Denoiser-local.
    step_consts: Any = None

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)

    @property
    def total_steps(self) -> int:
        return len(self.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.step]

    def branches(self) -> list[str]:
        return [b for b in BRANCH_ORDER if b in self.cond.branches]


@dataclass
class Frames:
    """Decoded output: float32 array (frames, H, W, 3) in [0, 1]; an image is one frame. Whether it
    is a video is the family's ``is_video`` (a one-frame Wan output is still a video), not the count."""

    array: np.ndarray

    def to_pil(self) -> list:
        from PIL import Image

        return [Image.fromarray(f) for f in self.to_uint8()]

    def to_uint8(self) -> np.ndarray:
        # Same rounding as diffusers' numpy_to_pil.
        return (self.array * 255).round().astype("uint8")


@dataclass
class Row:
    """One transformer input row: one request's one CFG branch at its current step."""

    state: DenoiseState
    branch: str


ForwardFn = Callable[[Sequence[Row]], torch.Tensor]


@dataclass
class StepStats:
    """What one ``denoise_step`` did: forwards and rows computed, for metrics and tests."""

    forwards: int = 0
    rows: int = 0


def to_frames(array: np.ndarray) -> Frames:
    """Normalise a pipeline's np output to (frames, H, W, 3) float32."""
    a = np.asarray(array, dtype=np.float32)
    if a.ndim == 3:
        a = a[None]
    return Frames(a)
