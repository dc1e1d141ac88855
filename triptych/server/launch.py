"""Embedded topology: the orchestrator plus N encoder, M denoiser and K decoder local worker processes.

``LocalWorkers`` is the supervision component: it spawns worker processes (connected over loopback
to the orchestrator's control port), signals and reaps them. It owns those processes: nothing else
starts or kills them. ``EmbeddedBackend`` composes an ``Orchestrator`` and a ``LocalWorkers``:
``start`` spawns the topology and waits until every worker registered; ``close`` shuts them down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from triptych.pipelines.vlm import ChatResult
from triptych.server.backend import ChatJob, GenerationBackend, GenerationJob, ProgressFn, TextFn
from triptych.server.orchestrator import Orchestrator, OrchestratorConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopologyConfig:
    """How many local workers of each role, and how they run."""

    encoders: int = 1
    """Encoder processes (>= 0; 0 leaves the pool to remote workers)."""
    denoisers: int = 1
    """Denoiser processes (>= 0)."""
    decoders: int = 1
    """Decoder processes (>= 0)."""
    transfer: str = "auto"
    """Transfer backend of every local worker: auto | mooncake | zmq."""
    capacity: int = 4
    """Slots per worker (requests it may hold at once)."""
    torch_threads: int = 0
    """torch threads per worker (0 = torch's default)."""
    start_timeout_s: float = 300.0
    """How long ``start`` waits for every local worker to register."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra ``triptych worker`` flags for every worker (e.g. ``--max-batch-requests 4``)."""

    def __post_init__(self) -> None:
        for name in ("encoders", "denoisers", "decoders"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.transfer not in ("auto", "mooncake", "zmq"):
            raise ValueError(f"transfer={self.transfer!r} must be one of auto, mooncake, zmq")
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity} must be >= 1")


class LocalWorkers:
    """Worker processes of this head (see the module docstring)."""

    def __init__(self, model_dir: Path, topology: TopologyConfig, token: str):
        self.model_dir = model_dir
        self.token = token  # handed to workers in their environment, never on a command line
        self.topology = topology
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, role: str, head: str, instance_id: str | None = None) -> str:
        """Start one local worker process of ``role`` that registers with ``head``; returns its id."""
        n = sum(1 for i in self.procs if i.startswith(f"{role}-"))
        instance_id = instance_id or f"{role}-{n}"
        t = self.topology
        cmd = [
            sys.executable,
            "-m",
            "triptych.cli",
            "worker",
            "--role",
            role,
            "--head",
            head,
            "--model",
            str(self.model_dir),
            "--instance-id",
            instance_id,
            "--transfer",
            t.transfer,
            "--capacity",
            str(t.capacity),
            "--threads",
            str(t.torch_threads),
            "--exit-with-parent",
            str(os.getpid()),
            *t.extra_args,
        ]
        if logger.isEnabledFor(logging.DEBUG):
            cmd.insert(3, "-v")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRIPTYCH_TOKEN": self.token}
        self.procs[instance_id] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        logger.info("spawned %s (pid %d)", instance_id, self.procs[instance_id].pid)
        return instance_id

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a local worker (tests: kill -9 mid-request)."""
        self.procs[instance_id].send_signal(sig)

    async def reap(self, timeout_s: float = 15.0) -> None:
        """Wait for every process to exit (after a shutdown was sent); kill what does not."""
        for instance_id, proc in self.procs.items():
            try:
                await asyncio.to_thread(proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("worker %s did not stop; killing pid %d", instance_id, proc.pid)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        self.procs.clear()


class EmbeddedBackend(GenerationBackend):
    """An ``Orchestrator`` and its ``LocalWorkers`` (see the module docstring)."""

    def __init__(
        self, model_dir: str | Path, config: OrchestratorConfig | None = None, topology: TopologyConfig | None = None
    ):
        self.orchestrator = Orchestrator(model_dir, config)
        self.topology = topology or TopologyConfig()
        self.workers = LocalWorkers(self.orchestrator.model_dir, self.topology, self.orchestrator.token)
        self.family = self.orchestrator.family
        self.metrics = self.orchestrator.metrics

    async def start(self) -> None:
        await self.orchestrator.start()
        t = self.topology
        counts = {"encoder": t.encoders, "denoiser": t.denoisers, "decoder": t.decoders}
        try:
            for role, n in counts.items():
                for _ in range(n):
                    self.spawn(role)
            await self.orchestrator.wait_for_instances(counts, t.start_timeout_s)
        except BaseException:
            await self.close()
            raise

    def spawn(self, role: str, instance_id: str | None = None) -> str:
        return self.workers.spawn(role, self.orchestrator.control_address, instance_id)

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        self.workers.kill(instance_id, sig)

    async def close(self) -> None:
        if self.orchestrator.control.open:
            self.orchestrator.shutdown_workers()
        await self.orchestrator.close()
        await self.workers.reap()

    async def run(self, job: GenerationJob, on_progress: ProgressFn | None = None) -> bytes:
        return await self.orchestrator.run(job, on_progress)

    async def chat(self, job: ChatJob, on_text: TextFn | None = None) -> ChatResult:
        return await self.orchestrator.chat(job, on_text)

    async def cancel(self, request_id: str) -> bool:
        return await self.orchestrator.cancel(request_id)

    def describe(self) -> dict:
        return self.orchestrator.describe()
