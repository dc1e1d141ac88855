"""One request in this process through the serving engine (``triptych generate``, the in-process
backend, training evaluations, tests, benchmarks).

encode → ``DenoiserEngine`` (``add``, then ``run_until_done``: the schedule → execute → update tick a
denoiser worker runs) → decode. Nothing here steps the model itself: fused CFG, TeaCache admission,
adapters and the preview index are the engine's, so a request run here is the request served alone.
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
    """Resolve, encode, prepare, denoise in an engine of its own until done, decode. ``params`` may be
    unresolved.

    ``fuse_cfg=True`` (default) runs both CFG branches in one forward, as the serving engine does,
    so a request served alone equals this; ``False`` runs them as diffusers does (bit-identical).
    ``accel``: the engine's acceleration (a ``triptych.accel.teacache.TeaCache``); the engine admits
    the request to it (``params.teacache_threshold`` > 0 without one is refused, as served).
    ``on_step(state)`` after each of the request's steps (what it raises aborts the request).
    ``previews``: how many previews (``engine.previews``) to decode and hand to ``on_preview``
    (their decode time counts as denoising); they do not change the result.
    """
    from triptych.engine import DenoiserEngine, EngineConfig

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
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1, fuse_cfg=fuse_cfg), accel=accel)

    def on_tick(out) -> None:
        for _, index, _, _, x0 in out.previews:
            on_preview(index, family.decode(x0, params))
        if on_step is not None and out.batch:
            on_step(state)

    engine.add(state)  # adapters acquired, TeaCache admitted (InvalidParam when unusable)
    try:
        engine.run_until_done(on_tick)
    finally:
        engine.abort(request_id)  # a raising callback: release its adapters and cache state
    timings.add("denoise", t)
    t = time.perf_counter()
    frames = family.decode(state.latents, params)
    timings.add("decode", t)
    return frames, timings
