"""Embedded topology: the orchestrator plus N encoder, M denoiser and K decoder local worker processes.

``supervisor.LocalWorkers`` is the supervision component: it spawns worker processes (connected over
loopback to the orchestrator's control port), restarts the ones that exit, and reaps them.
``EmbeddedBackend`` composes an ``Orchestrator`` and a ``supervisor.WorkerPool`` (``LocalWorkers``
by default; ``triptych.deploy.ray_backend.RayWorkers`` places them as Ray actors): ``start`` spawns
the topology and waits until every worker registered; a worker that exits is declared dead at once
(its requests are retried) and restarted; ``close`` shuts them down. With an ``AutoscaleConfig`` a
``deploy.autoscale.Autoscaler`` grows and drains pools while it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from triptych.chat import ChatResult
from triptych.control.backend import ChatJob, GenerationBackend, GenerationJob, PreviewFn, ProgressFn, TextFn
from triptych.control.orchestrator import Orchestrator, OrchestratorConfig
from triptych.control.worker_config import WorkerConfig
from triptych.core.devices import DeviceConfig
from triptych.core.kinds import ROLES, Role, TransferKind
from triptych.core.startup import startup_log
from triptych.deploy.supervisor import LocalWorkers, WorkerPool
from triptych.parallel import ParallelConfig

if TYPE_CHECKING:
    from triptych.deploy.config import AutoscaleConfig

logger = logging.getLogger(__name__)


#: Mooncake's log levels (``MC_LOG_LEVEL``), most verbose first.
MOONCAKE_LOG_LEVELS = ("INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class TopologyConfig:
    """How many local workers of each role, and how they run."""

    encoders: int = 1
    """Encoder processes (>= 0; 0 leaves the pool to remote workers)."""
    denoisers: int = 1
    """Denoiser processes (>= 0)."""
    decoders: int = 1
    """Decoder processes (>= 0)."""
    transfer: TransferKind = WorkerConfig.transfer
    """Transfer backend of every local worker."""
    capacity: int = WorkerConfig.capacity
    """Slots per worker (requests it may hold at once)."""
    torch_threads: int = 0
    """torch threads per local worker; 0 = the machine's cores split evenly among the local workers."""
    denoiser_threads: int = 0
    """torch threads per denoiser process (each rank of a multi-rank one), in place of
    ``torch_threads`` for that role; 0 = as every worker. For machines with cores to spare: the
    denoiser is the busy process of a served load. On a 2-core CPU it did not pay, as the other
    workers take their turns on the same cores (benchmarks/RESULTS.md, "Served at 1 / 4 / 8")."""
    start_timeout_s: float = 300.0
    """How long ``start`` waits for every local worker to register."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra ``triptych worker`` flags for every worker (e.g. ``--max-batch-requests 4``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """CFG × Ulysses × ring degrees of every local denoiser (each one instance of that many ranks)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """Device and dtype of every local worker; with ``gpus``, the CUDA index is assigned per worker."""
    gpus: tuple[int, ...] = ()
    """CUDA device indices for local workers (``--gpus 0,1,2,3``): denoisers take them first, one
    each (a multi-rank denoiser takes as many as it has ranks), then encoders and decoders share
    what is left (or the last one). Empty: every worker uses ``device``."""
    restart: bool = True
    """Restart a local worker whose process exited while the head runs."""
    restart_backoff_s: float = 1.0
    """Wait before the first restart of a worker; doubles with each restart inside the crash-loop
    window, up to 30 s."""
    crash_loop_limit: int = 5
    """A worker that needed this many restarts within ``crash_loop_window_s`` is given up on."""
    crash_loop_window_s: float = 300.0
    """The window of ``crash_loop_limit``."""
    mooncake_log_level: str = "ERROR"
    """Mooncake's console log level in local workers (its ``MC_LOG_LEVEL``): ERROR keeps its INFO and
    WARNING lines (several per worker and transfer) off the serve console; INFO shows them all."""

    def __post_init__(self) -> None:
        for name in ("encoders", "denoisers", "decoders"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.transfer not in set(TransferKind):
            raise ValueError(f"transfer={self.transfer!r} must be one of {', '.join(TransferKind)}")
        object.__setattr__(self, "transfer", TransferKind(self.transfer))  # a plain string as its member
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity} must be >= 1")
        for name in ("torch_threads", "denoiser_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: split the idle cores)")
        if self.gpus and self.device.torch_device.type != "cuda":
            raise ValueError(
                f"gpus={self.gpus} places workers on CUDA devices: use device cuda (not {self.device.device})"
            )
        if self.mooncake_log_level not in MOONCAKE_LOG_LEVELS:
            raise ValueError(f"mooncake_log_level={self.mooncake_log_level!r} must be one of {MOONCAKE_LOG_LEVELS}")
        if self.restart_backoff_s <= 0 or self.crash_loop_limit < 1 or self.crash_loop_window_s <= 0:
            raise ValueError(
                f"restart_backoff_s={self.restart_backoff_s} and crash_loop_window_s={self.crash_loop_window_s} "
                f"must be > 0, crash_loop_limit={self.crash_loop_limit} >= 1"
            )

    def count(self, role: Role) -> int:
        """Local workers of ``role``."""
        return {Role.ENCODER: self.encoders, Role.DENOISER: self.denoisers, Role.DECODER: self.decoders}[role]

    def threads(self, role: Role) -> int:
        """torch threads of one process of ``role`` as set (0: the caller splits the cores)."""
        if role == Role.DENOISER and self.denoiser_threads:
            return self.denoiser_threads
        return self.torch_threads

    def ranks(self, role: Role) -> int:
        """Processes of one instance of ``role``: the denoiser's ranks, 1 for the others."""
        return self.parallel.world_size if role == Role.DENOISER else 1

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Instance id → the CUDA devices it sees (``CUDA_VISIBLE_DEVICES``), from ``gpus``: each
        denoiser takes as many as it has ranks, in order; encoders and decoders then take the rest
        round robin (the last GPU when none is left). Empty without ``gpus``."""
        if not self.gpus:
            return {}
        out, free = {}, list(self.gpus)
        per = self.parallel.world_size
        for i in range(self.denoisers):
            taken, free = free[:per], free[per:]
            if len(taken) < per:
                raise ValueError(
                    f"gpus={self.gpus}: {self.denoisers} denoisers of {per} rank(s) need {self.denoisers * per}"
                )
            out[f"denoiser-{i}"] = tuple(taken)
        rest = free or [self.gpus[-1]]
        others = [f"encoder-{i}" for i in range(self.encoders)] + [f"decoder-{i}" for i in range(self.decoders)]
        for n, iid in enumerate(others):
            out[iid] = (rest[n % len(rest)],)
        return out

    def device_for(self, role: Role, instance_id: str) -> DeviceConfig:
        """The device flags of one local worker: with ``gpus`` its visible devices start at cuda:0."""
        if instance_id in self.layout():
            return dataclasses.replace(self.device, device="cuda")
        return self.device


class EmbeddedBackend(GenerationBackend):
    """An ``Orchestrator`` and its ``LocalWorkers`` (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        config: OrchestratorConfig | None = None,
        topology: TopologyConfig | None = None,
        pool: Callable[..., WorkerPool] = LocalWorkers,
        autoscale: AutoscaleConfig | None = None,
    ):
        self.orchestrator = Orchestrator(model_dir, config)
        self.topology = topology or TopologyConfig()
        self.autoscale = autoscale
        self.autoscaler = None
        self.workers: WorkerPool = pool(
            self.orchestrator.model_dir,
            self.topology,
            self.orchestrator.token,
            self._exited,
            self.orchestrator.registry.expect,
        )
        self.family = self.orchestrator.family
        self.metrics = self.orchestrator.metrics

    async def start(self) -> None:
        await self.orchestrator.start()
        t = self.topology
        counts = {role: t.count(role) for role in ROLES}
        layout = t.layout()
        if layout:
            logger.info("local workers on GPUs: %s", ", ".join(f"{i} -> {g}" for i, g in layout.items()))
        model = self.orchestrator.model_dir.name
        t0 = time.monotonic()
        try:
            for role, n in counts.items():
                for _ in range(n):
                    instance = self.spawn(role)
                    startup_log.info("%s: %s worker %s loading the model", model, role, instance)
            await self.orchestrator.wait_for_instances(counts, t.start_timeout_s)
            total = sum(counts.values())
            startup_log.info("%s ready: %d workers in %.1fs", model, total, time.monotonic() - t0)
            self.workers.watch(self.orchestrator.control_address)
            if self.autoscale is not None and self.autoscale.pools:
                from triptych.deploy.autoscale import Autoscaler

                head = self.orchestrator.control_address
                self.autoscaler = Autoscaler(self.orchestrator, self.workers, head, self.autoscale)
                self.autoscaler.start()
        except BaseException:
            await self.close()
            raise

    def spawn(self, role: Role, instance_id: str | None = None) -> str:
        return self.workers.spawn(role, self.orchestrator.control_address, instance_id)

    def _exited(self, instance_id: str, returncode: int) -> None:
        self.orchestrator.instance_dead(instance_id, f"its process exited with code {returncode}")

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        self.workers.kill(instance_id, sig)

    async def close(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        await self.workers.stop_watching()
        if self.orchestrator.control.open:
            self.orchestrator.shutdown_workers()
        await self.orchestrator.close()
        await self.workers.reap()

    async def run(
        self, job: GenerationJob, on_progress: ProgressFn | None = None, on_preview: PreviewFn | None = None
    ) -> bytes:
        return await self.orchestrator.run(job, on_progress, on_preview)

    async def chat(self, job: ChatJob, on_text: TextFn | None = None) -> ChatResult:
        return await self.orchestrator.chat(job, on_text)

    def check_deadlines(self, jobs: list[GenerationJob]) -> None:
        self.orchestrator.check_deadlines(jobs)

    async def cancel(self, request_id: str) -> bool:
        return await self.orchestrator.cancel(request_id)

    def describe(self) -> dict:
        out = {**self.orchestrator.describe(), "local_workers": self.workers.describe()}
        if self.autoscaler is not None:
            out["autoscale"] = self.autoscaler.describe()
        return out
