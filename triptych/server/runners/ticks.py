"""What every rank of a multi-rank denoiser does with one tick (contract 8: decided once on rank 0).

Rank 0 applies its aborts and joins, schedules, and broadcasts the result as a ``Tick`` (requests
that leave, requests that join with their parameters, the batch to step, in order), then each
joining request's conditioning; every follower applies it with ``follow_tick``: the same aborts,
the same ``prepare`` (initial noise comes from the request's seed, so it needs no broadcast), the
same adds in the same order, the same batch. Nothing is pickled: the
tick is msgspec bytes, the tensors travel as tensors (``triptych.parallel.broadcast``).
"""

from __future__ import annotations

import msgspec
import torch

from triptych.parallel import ParallelConfig, ParallelGroups, broadcast_message, broadcast_tensors
from triptych.pipelines.base import Conditioning
from triptych.server import protocol as P
from triptych.server import wire
from triptych.server.engine import DenoiserEngine, EngineConfig
from triptych.server.runners.base import RunnerBroken


class Join(msgspec.Struct, frozen=True):
    request_id: str
    params: P.WireParams


class Tick(msgspec.Struct, frozen=True):
    """One step boundary of the instance, as rank 0 decided it."""

    aborted: list[str]  # requests that leave the engine first
    joined: list[Join]  # then these join, in this order (their conditioning follows, one broadcast each)
    batch: list[str]  # the batch to step, in rank 0's scheduled order (empty: no step)
    stop: bool = False  # the instance is closing: followers leave their loop


class RankSetup(msgspec.Struct, frozen=True):
    """What rank 0 tells its followers once, after the process group formed."""

    model_dir: str
    dtype: str | None
    engine: EngineConfig
    parallel: ParallelConfig
    teacache_profiles_dir: str | None = None  # the worker's (WorkerConfig.teacache_profiles_dir)
    quantize: list[str] = []  # rank 0's SpeedConfig.quantize: every rank quantizes its transformer alike


class InstanceBroken(RunnerBroken):
    """A collective failed or ranks may have diverged (a rank died, hung past the collective timeout,
    or a step raised on some rank): the instance must leave service as a whole."""


def instance_engine(family, config: EngineConfig, parallelism, profiles_dir=None) -> DenoiserEngine:
    """The engine of one rank of an instance (every rank builds the same one): the family's forward
    wrapped by the CFG split, and TeaCache composed with the ranks where the model allows it
    (``profiles_dir``: looked up before the model's own profiles, as ``make_teacache``)."""
    from triptych.pipelines.teacache import make_teacache

    try:
        accel, why = make_teacache(family, profiles_dir, ranks=parallelism.for_cache()), ""
    except ValueError as e:  # e.g. a model whose sequence split TeaCache's forward would bypass
        accel, why = None, str(e)
    return DenoiserEngine(family, config, accel=accel, wrap=parallelism.wrap, no_accel=why)


def step(engine: DenoiserEngine, batch: list[str], groups):
    """Step ``batch`` (every rank the same); a step that raised may have raised on some ranks only,
    so the instance cannot go on."""
    out = engine.step(order=batch)
    if out.failed:
        raise InstanceBroken(f"a step failed on rank {groups.rank}: {out.failed[0][1]}")
    return out


def follow_tick(tick: Tick, family, engine: DenoiserEngine, groups) -> None:
    """Apply rank 0's ``tick`` on a follower: the same aborts, the same joins (``prepare`` draws the
    initial noise from the request's seed, so the latents need no broadcast), the same batch."""
    for rid in tick.aborted:
        engine.abort(rid)
    for join in tick.joined:
        flat = broadcast_tensors(None, groups)
        with torch.no_grad():
            state = family.prepare(join.request_id, wire.params_from_wire(join.params), Conditioning.from_flat(flat))
        engine.add(state)
    if tick.batch:
        step(engine, tick.batch, groups)


def follow(family, engine: DenoiserEngine, groups: ParallelGroups) -> None:
    """A follower rank's loop: apply rank 0's ticks until it says stop (or a collective fails)."""
    while True:
        tick = broadcast_message(None, Tick, groups)
        if tick.stop:
            return
        follow_tick(tick, family, engine, groups)
