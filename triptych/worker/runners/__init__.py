"""Role runners: the stage half of a worker process (``worker/process.py`` is the process half).

``make_runner`` picks the runner for a role; a runner talks to its worker only through a
``WorkerPort`` (``runners/base.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from triptych.core.kinds import Role
from triptych.worker.runners.base import Job, RunnerBroken, StageRunner, WorkerPort
from triptych.worker.runners.decoder import DecoderRunner
from triptych.worker.runners.denoiser import DenoiserRunner
from triptych.worker.runners.encoder import EncoderRunner


def _denoiser(family, port: WorkerPort, config) -> StageRunner:
    if config.parallel.world_size > 1:
        from triptych.worker.runners.parallel_denoiser import ParallelDenoiserRunner

        return ParallelDenoiserRunner(
            family,
            port,
            config.engine,
            config.parallel,
            config.collective_timeout_s,
            str(config.model_dir),
            config.device.device,
            dtype=config.device.dtype,
            threads=config.torch_threads,
            profiles_dir=config.teacache_profiles_dir,
        )
    from triptych.engine import DenoiserEngine
    from triptych.engine.teacache import make_teacache

    engine = DenoiserEngine(family, config.engine, accel=make_teacache(family, config.teacache_profiles_dir))
    return DenoiserRunner(family, port, engine)


def _encoder(family, port: WorkerPort, config) -> StageRunner:
    engine = None
    if getattr(config, "chat_vllm_url", ""):
        from triptych.vllm_chat.engine import VllmChatEngine

        engine = VllmChatEngine(config.chat_vllm_url, wake=getattr(port, "wake", lambda: None))
    return EncoderRunner(family, port, config.chat, chat_engine=engine)


RUNNERS: dict[Role, Callable[..., StageRunner]] = {
    Role.ENCODER: _encoder,
    Role.DENOISER: _denoiser,
    Role.DECODER: lambda family, port, config: DecoderRunner(family, port),
}


def make_runner(role: Role, family, port: WorkerPort, config) -> StageRunner:
    """``config``: the worker's ``WorkerConfig`` (engine, parallel degrees, device...). The runner
    meters the model FLOPs it executes (``triptych.plan``): the whole instance's on a multi-rank one,
    rated against all its ranks' peak."""
    runner = RUNNERS[role](family, port, config)
    meter_flops(runner, role, family, config)
    return runner


def meter_flops(runner: StageRunner, role: Role, family, config) -> None:
    from pathlib import Path

    from triptych.plan import costs
    from triptych.plan.meter import FlopMeter

    ranks = config.parallel.world_size if role == Role.DENOISER else 1
    runner.meter = FlopMeter(Path(config.model_dir).name, str(family.device), ranks)
    if role == Role.DENOISER:
        runner.engine.flop_costs = costs.RowCosts(family)
    else:
        runner.costs = (costs.EncodeCosts if role == Role.ENCODER else costs.DecodeCosts)(family)


__all__ = ["Job", "RunnerBroken", "StageRunner", "WorkerPort", "make_runner", "RUNNERS"]
