"""Role runners: the stage half of a worker process (``server/worker.py`` is the process half).

``make_runner`` picks the runner for a role; a runner talks to its worker only through a
``WorkerPort`` (``runners/base.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from triptych.pipelines.base import Role
from triptych.server.engine import EngineConfig
from triptych.server.runners.base import Job, StageRunner, WorkerPort
from triptych.server.runners.decoder import DecoderRunner
from triptych.server.runners.denoiser import DenoiserRunner
from triptych.server.runners.encoder import EncoderRunner


def _denoiser(family, port: WorkerPort, engine: EngineConfig) -> StageRunner:
    from triptych.pipelines.teacache import make_teacache

    return DenoiserRunner(family, port, engine, accel=make_teacache(family))


RUNNERS: dict[Role, Callable[..., StageRunner]] = {
    Role.ENCODER: lambda family, port, engine: EncoderRunner(family, port),
    Role.DENOISER: _denoiser,
    Role.DECODER: lambda family, port, engine: DecoderRunner(family, port),
}


def make_runner(role: Role, family, port: WorkerPort, engine: EngineConfig) -> StageRunner:
    return RUNNERS[role](family, port, engine)


__all__ = ["Job", "StageRunner", "WorkerPort", "make_runner", "RUNNERS"]
