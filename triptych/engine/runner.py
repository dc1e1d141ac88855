"""Run one request through all stages in one process (``triptych generate``, tests, benchmarks).

The same stage code runs in the pools; here the stages are called back to back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from triptych.engine.previews import preview_steps
from triptych.families.base import DenoiseState, Family, Frames, GenerationParams
from triptych.mmcache.cache import tenant_scope

StepCallback = Callable[[DenoiseState], None]
PreviewCallback = Callable[[int, Frames], None]  # (0-based preview index, the decoded preview)


@dataclass
class StageTimings:
    """Wall seconds per stage of one request."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, start: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


def run_request(
    family: Family,
    params: GenerationParams,
    request_id: str = "local",
    on_step: StepCallback | None = None,
    fuse_cfg: bool = True,
    accel=None,
    previews: int = 0,
    on_preview: PreviewCallback | None = None,
) -> tuple[Frames, StageTimings]:
    """Resolve, encode, prepare, denoise until done, decode. ``params`` may be unresolved.

    ``fuse_cfg=True`` (default) runs both CFG branches in one forward, as the serving engine does,
    so a request served alone equals this; ``False`` runs them as diffusers does (bit-identical).
    ``accel``: an acceleration owning per-request state (``admit``/``bind``/``release``, e.g. a
    ``triptych.accel.teacache.TeaCache``), used when ``params.teacache_threshold`` > 0.
    ``previews``: how many previews (``engine.previews``) to decode and hand to ``on_preview``
    (their decode time counts as denoising); they do not change the result.
    """
    timings = StageTimings()
    params = family.resolve(params)
    t = time.perf_counter()
    with tenant_scope(params.tenant):
        cond = family.encode(params)
    timings.add("encode", t)
    t = time.perf_counter()
    state = family.prepare(request_id, params, cond)
    if on_preview is not None:
        state.preview_steps = preview_steps(previews, state.total_steps)
    forward = None
    if accel is not None and params.teacache_threshold > 0:
        accel.admit(request_id, params.teacache_threshold, state.total_steps)
        forward = accel.bind(family.forward)
    if params.lora:  # the engine does this on add; an instance without adapters refuses in lora_plan
        family.lora.acquire(request_id, params.lora)
    try:
        while not state.done:
            family.denoise_step([state], fuse_cfg=fuse_cfg, forward=forward)
            if state.x0 is not None:
                x0, state.x0 = state.x0, None
                on_preview(sorted(state.preview_steps).index(state.step), family.decode(x0, params))
            if on_step is not None:
                on_step(state)
    finally:
        if accel is not None:
            accel.release(request_id)
        if params.lora:
            family.lora.release(request_id)
    timings.add("denoise", t)
    t = time.perf_counter()
    frames = family.decode(state.latents, params)
    timings.add("decode", t)
    return frames, timings
