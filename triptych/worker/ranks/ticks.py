"""What every rank of a multi-rank denoiser does with one tick (decided once on rank 0).

Rank 0 applies its aborts and joins, schedules, and broadcasts the result as a ``Tick`` (requests
that leave, requests that join with their parameters, the batch to step, in order), then each
joining request's conditioning; every follower applies it with ``follow_tick``: the same aborts,
the same ``prepare`` (initial noise comes from the request's seed, so it needs no broadcast), the
same adds in the same order, the same batch. Nothing is pickled: the
tick is msgspec bytes, the tensors travel as tensors (``triptych.parallel.broadcast``).

A join that names adapters may fail on a follower where it succeeded on rank 0 (an adapter file
that cannot be read there, its budget): after the joins every rank reports which of them it could
not add (``settle_joins``, one all-reduce, run only when a join names an adapter), every rank drops
those from its engine (releasing what they acquired) and from the batch, and rank 0 fails them with
the first failing rank's message. The instance goes on; nothing waits for a collective timeout.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from triptych.control import protocol as P
from triptych.control import wire
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import Conditioning
from triptych.lora.config import LoraConfig
from triptych.parallel import ParallelConfig, ParallelGroups, broadcast_message, broadcast_tensors
from triptych.worker.runners.base import RunnerBroken


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
    lora: LoraConfig | None = None  # the adapters rank 0 serves (same files, same budget); None = none
    quantize: list[str] = []  # rank 0's SpeedConfig.quantize: every rank quantizes its transformer alike
    compile: bool = False  # rank 0's SpeedConfig.compile: every rank compiles its transformer's blocks alike
    cuda_graphs: bool = False  # rank 0's SpeedConfig.cuda_graphs: every rank's block stack replays as CUDA graphs
    compile_cache_dir: str | None = None  # rank 0's inductor cache (SpeedConfig.compile_cache_dir); None = inductor's
    warm_up: bool = False  # every rank warms up (compiles) after the parallelism attaches (ranks/warmup.py)


class InstanceBroken(RunnerBroken):
    """A collective failed or ranks may have diverged (a rank died, hung past the collective timeout,
    or a step raised on some rank): the instance must leave service as a whole."""


def instance_engine(family, config: EngineConfig, parallelism, profiles_dir=None) -> DenoiserEngine:
    """The engine of one rank of an instance (every rank builds the same one): the family's forward
    wrapped by the CFG split, and TeaCache composed with the ranks where the model allows it
    (``profiles_dir``: looked up before the model's own profiles, as ``make_teacache``)."""
    from triptych.engine.teacache import make_teacache

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


def settle_joins(tick: Tick, errors: dict[str, str], engine: DenoiserEngine, groups) -> dict[str, str]:
    """Every rank, after adding ``tick.joined``: the joins some rank could not add (``errors``: this
    rank's, request id → message), each with the message of the lowest rank that failed it; they
    leave every engine here. No collective unless a join names an adapter (the only joins that can
    fail on a follower alone: rank 0 broadcasts only the joins it added)."""
    if not any(j.params.lora for j in tick.joined):
        return {}
    world = dist.get_world_size(groups.world)
    first = torch.tensor([groups.rank if j.request_id in errors else world for j in tick.joined], device=groups.device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=groups.world)
    failed = {}
    for join, src in zip(tick.joined, first.tolist()):
        if src < world:
            mine = errors.get(join.request_id) if groups.rank == src else None
            failed[join.request_id] = f"rank {src}: " + broadcast_message(mine, str, groups, src=src)
            engine.abort(join.request_id)  # releases its adapters where it was added
    return failed


def lead_tick(tick: Tick, conds: list, engine: DenoiserEngine, groups):
    """Rank 0's half of a tick (its aborts and joins already applied to ``engine``): broadcast it and
    the joins' conditioning, settle the joins, step. Returns (the step's output or None, the joins
    that failed on a follower: request id → message)."""
    broadcast_message(tick, Tick, groups)
    for flat in conds:
        broadcast_tensors(flat, groups)
    failed = settle_joins(tick, {}, engine, groups)
    batch = [rid for rid in tick.batch if rid not in failed]
    return (step(engine, batch, groups) if batch else None), failed


def follow_tick(tick: Tick, family, engine: DenoiserEngine, groups) -> None:
    """Apply rank 0's ``tick`` on a follower: the same aborts, the same joins (``prepare`` draws the
    initial noise from the request's seed, so the latents need no broadcast), the same batch."""
    for rid in tick.aborted:
        engine.abort(rid)
    errors = {}
    for join in tick.joined:
        flat = broadcast_tensors(None, groups)
        with torch.no_grad():
            state = family.prepare(join.request_id, wire.params_from_wire(join.params), Conditioning.from_flat(flat))
        try:
            engine.add(state)
        except Exception as e:  # noqa: BLE001 - an adapter this rank cannot load (any reader error)
            if not join.params.lora:
                raise  # not a LoRA join: rank 0 added it the same way, so the ranks diverged
            errors[join.request_id] = f"{type(e).__name__}: {e}"
    failed = settle_joins(tick, errors, engine, groups)
    batch = [rid for rid in tick.batch if rid not in failed]
    if batch:
        step(engine, batch, groups)


def follow(family, engine: DenoiserEngine, groups: ParallelGroups) -> None:
    """A follower rank's loop: apply rank 0's ticks until it says stop (or a collective fails)."""
    while True:
        tick = broadcast_message(None, Tick, groups)
        if tick.stop:
            return
        follow_tick(tick, family, engine, groups)
