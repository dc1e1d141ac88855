"""One request on a multi-rank instance in this process (``triptych generate --ulysses 2 ...``).

This process is rank 0: it spawns the other ranks (``InstanceRanks``), encodes, and drives the
engine with ``run_until_done`` as ``run_request`` does, each tick scheduled here and broadcast as a
served instance's rank 0 does (``ranks/ticks``): one join, then one step per tick until the request
is done; it decodes and closes the ranks. Nothing of a worker or the head is involved.
"""

from __future__ import annotations

import time

import torch

from triptych.control import wire
from triptych.core.errors import InvalidParam, TriptychError
from triptych.engine import EngineConfig
from triptych.engine.runner import StageTimings, StepCallback
from triptych.families.base import Conditioning, DenoiseState, Family, Frames, GenerationParams
from triptych.mmcache.cache import tenant_scope
from triptych.parallel import ParallelConfig
from triptych.worker.ranks.instance import InstanceRanks
from triptych.worker.ranks.ticks import Join, Tick, instance_engine, lead_tick


def run_parallel_request(
    family: Family,
    params: GenerationParams,
    parallel: ParallelConfig,
    device: str = "cpu",
    on_step: StepCallback | None = None,
    collective_timeout_s: float = 120.0,
    threads: int = 0,
) -> tuple[Frames, StageTimings]:
    """Resolve, encode, denoise on ``parallel.world_size`` ranks, decode (``family`` holds every role)."""
    timings = StageTimings()
    params = family.resolve(params)
    engine_config = EngineConfig(max_batch_requests=1)
    ranks = InstanceRanks(parallel, collective_timeout_s, threads)
    try:
        ranks.start(family, str(family.model_dir), device, None, engine_config)
    except ValueError as e:  # degrees the model cannot split by (e.g. Ulysses past its head count)
        raise InvalidParam("--cfg-parallel/--ulysses/--ring", str(parallel), str(e)) from None
    try:
        t = time.perf_counter()
        with torch.no_grad(), tenant_scope(params.tenant):
            flat = family.encode(params).flat()
        timings.add("encode", t)
        t = time.perf_counter()
        state = denoise_on_ranks(family, params, flat, ranks, engine_config, on_step)
        timings.add("denoise", t)
    finally:
        ranks.close()
    t = time.perf_counter()
    frames = family.decode(state.latents, params)
    timings.add("decode", t)
    return frames, timings


def denoise_on_ranks(
    family: Family,
    params: GenerationParams,
    flat: dict[str, torch.Tensor],
    ranks: InstanceRanks,
    engine_config: EngineConfig,
    on_step: StepCallback | None = None,
) -> DenoiseState:
    """One request (resolved ``params``, its conditioning ``flat``) denoised on the started ``ranks``,
    rank 0 here: one join, then one step per tick, as a served instance's rank 0 ticks."""
    engine = instance_engine(family, engine_config, ranks.parallelism)
    with torch.no_grad():
        state = family.prepare("local", params, Conditioning.from_flat(flat))
    engine.add(state)
    join = Join("local", wire.params_to_wire(params))
    _, failed = lead_tick(Tick([], [join], []), [flat], engine, ranks.groups)
    if failed:  # a follower could not load the request's adapters
        raise TriptychError(f"--lora failed on {failed['local']}")

    def tick():  # what a served instance's rank 0 does at each step boundary (parallel_denoiser)
        batch = [r.state.request_id for r in engine.schedule()]
        out, _ = lead_tick(Tick([], [], batch), [], engine, ranks.groups)
        return out

    engine.run_until_done(on_tick=None if on_step is None else lambda out: on_step(state), step=tick)
    return state
