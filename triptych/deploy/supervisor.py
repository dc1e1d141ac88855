"""Supervision of a head's local worker processes: spawn, watch, restart with backoff, reap.

``LocalWorkers`` owns the processes it spawned; nothing else starts or kills them (``kill`` is for
tests and operators). While ``watch`` runs, a process that exited is reaped at once, reported to
``on_exit`` (the backend declares the instance dead, so its requests are retried without waiting
for the heartbeat timeout), and started again under the same instance id after a backoff that
doubles with each restart inside the crash-loop window; a worker that crashes ``crash_loop_limit``
times inside that window is given up on (logged; ``/health`` shows it). A worker that is ``retire``d
(scaled in after draining) is reported once when it exits and never restarted.

``WorkerPool`` is what ``launch.EmbeddedBackend`` needs from a supervisor; ``LocalWorkers`` is the
local one, ``triptych.deploy.ray_backend.RayWorkers`` places the same worker command as Ray actors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from triptych.control.worker_config import WorkerConfig, worker_argv
from triptych.core.devices import split_threads
from triptych.core.kinds import ROLES, Role
from triptych.core.parallel_config import ParallelConfig

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


@dataclass
class _Worker:
    role: Role
    proc: subprocess.Popen
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts in the window
    restart_at: float | None = None  # when a dead one starts again
    given_up: bool = False
    retired: bool = False  # scaled in: reported when it exits, never restarted


class WorkerPool(Protocol):
    """Spawns, supervises and stops a head's workers. ``on_exit(instance_id, code)`` is called once per
    exit of a worker (the head declares it dead); ``on_start(role)`` when one starts."""

    def spawn(self, role: Role, head: str, instance_id: str | None = None) -> str:
        """Start one worker of ``role`` registering with ``head``; returns its instance id."""

    def watch(self, head: str) -> None:
        """Start supervising (restarts) on the running event loop."""

    async def stop_watching(self) -> None: ...

    def current(self, role: Role) -> list[str]:
        """Instance ids of the running (or starting, or restarting) workers of ``role``, retired ones
        excluded."""

    def retire(self, instance_id: str) -> None:
        """Do not restart ``instance_id`` when it exits (it was drained and told to shut down)."""

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None: ...

    def describe(self) -> dict: ...

    async def reap(self, timeout_s: float = 15.0) -> None:
        """Wait for every worker to exit after a shutdown was sent; kill what does not."""


def worker_config(
    topology, model_dir: Path, role: Role, head: str, instance_id: str, threads: int, token: str, parent_pid: int = 0
) -> WorkerConfig:
    """The ``WorkerConfig`` of one worker of ``topology`` (its host: the worker's default)."""
    t = topology
    return WorkerConfig(
        role=role,
        head=head,
        token=token,
        model_dir=Path(model_dir),
        instance_id=instance_id,
        capacity=t.capacity,
        transfer=t.transfer,
        torch_threads=threads,
        device=t.device_for(role, instance_id),
        parallel=t.parallel if t.ranks(role) > 1 else ParallelConfig(),
        parent_pid=parent_pid,
    )


def worker_command(config: WorkerConfig, extra_args: tuple[str, ...] = ()) -> list[str]:
    """The ``triptych worker`` command line that rebuilds ``config`` (``worker_argv``; the token is
    not on it) followed by ``extra_args`` (``TopologyConfig.extra_args``: engine, cache, LoRA flags)."""
    cmd = [sys.executable, "-m", "triptych.cli", "worker", *worker_argv(config), *extra_args]
    if logger.isEnabledFor(logging.DEBUG):
        cmd.insert(3, "-v")
    return cmd


class LocalWorkers:
    def __init__(
        self,
        model_dir: Path,
        topology,
        token: str,
        on_exit: Callable[[str, int], None],
        on_start: Callable[[str], None] = lambda role: None,
    ):
        self.on_start = on_start  # a worker of this role is starting (the head's grace for the role restarts)
        self.model_dir = model_dir
        self.topology = topology
        self.token = token  # handed to workers in their environment, never on a command line
        self.on_exit = on_exit
        self.workers: dict[str, _Worker] = {}
        self.restarts_total = 0
        self._head = ""
        self._task: asyncio.Task | None = None
        self._threads: int | None = None

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {iid: w.proc for iid, w in self.workers.items()}

    def spawn(self, role: Role, head: str, instance_id: str | None = None) -> str:
        """Start one local worker process of ``role`` that registers with ``head``; returns its id."""
        n = 0
        while f"{role}-{n}" in self.workers:  # retired workers stay listed, so an id is never reused
            n += 1
        instance_id = instance_id or f"{role}-{n}"
        self.workers[instance_id] = _Worker(role, self._start(role, head, instance_id))
        return instance_id

    def _start(self, role: Role, head: str, instance_id: str) -> subprocess.Popen:
        t = self.topology
        config = worker_config(t, self.model_dir, role, head, instance_id, self.threads(role), self.token, os.getpid())
        cmd = worker_command(config, t.extra_args)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRIPTYCH_TOKEN": self.token}
        env["MC_LOG_LEVEL"] = t.mooncake_log_level  # read by Mooncake when a transfer engine starts
        gpus = t.layout().get(instance_id)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        self.on_start(role)
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        logger.info("spawned %s (pid %d)", instance_id, proc.pid)
        return proc

    def threads(self, role: Role) -> int:
        """torch threads of a local worker of ``role``: ``topology.threads(role)`` (``--threads``, or
        ``--denoiser-threads`` for a denoiser), or (0) the machine's cores split evenly among the
        topology's local workers (``devices.split_threads``: less the cores the load average says are
        busy), so they do not oversubscribe the CPU."""
        t = self.topology
        if t.threads(role):
            return t.threads(role)
        if self._threads is None:  # once: later spawns would count the running workers as load
            self._threads = split_threads(sum(t.count(role) * t.ranks(role) for role in ROLES))
        return self._threads

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a local worker (tests: kill -9 mid-request)."""
        self.workers[instance_id].proc.send_signal(sig)

    def current(self, role: Role) -> list[str]:
        return sorted(i for i, w in self.workers.items() if w.role == role and not (w.given_up or w.retired))

    def retire(self, instance_id: str) -> None:
        self.workers[instance_id].retired = True

    # ---- supervision ----------------------------------------------------------------------------
    def watch(self, head: str, interval_s: float = 0.25) -> None:
        """Start supervising (on the running event loop) the workers spawned so far and later."""
        self._head = head
        self._task = asyncio.create_task(self._watch(interval_s), name="local-workers")

    async def stop_watching(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One supervision pass: reap and report exits, start due restarts."""
        t = self.topology
        for iid, w in self.workers.items():
            if w.given_up:
                continue
            if w.restart_at is None:
                code = w.proc.poll()
                if code is None:
                    continue
                self.on_exit(iid, code)
                if w.retired:
                    w.given_up = True
                    logger.info("%s retired (exit code %d)", iid, code)
                    continue
                if not t.restart:
                    w.given_up = True
                    continue
                w.restarts = [r for r in w.restarts if now - r < t.crash_loop_window_s]
                if len(w.restarts) >= t.crash_loop_limit:
                    w.given_up = True
                    logger.error(
                        "%s exited %d times within %.0fs; not restarting it",
                        iid,
                        len(w.restarts) + 1,
                        t.crash_loop_window_s,
                    )
                    continue
                backoff = min(MAX_BACKOFF_S, t.restart_backoff_s * 2 ** len(w.restarts))
                w.restart_at = now + backoff
                logger.warning("%s exited with code %d; restarting it in %.1fs", iid, code, backoff)
            elif now >= w.restart_at:
                w.restart_at = None
                w.restarts.append(now)
                self.restarts_total += 1
                w.proc = self._start(w.role, self._head, iid)

    def describe(self) -> dict:
        return {
            "restarts": self.restarts_total,
            "layout": {iid: list(g) for iid, g in self.topology.layout().items()},
            "device": self.topology.device.device,
            "workers": {
                iid: {
                    "role": w.role,
                    "pid": w.proc.pid,
                    "running": w.proc.poll() is None,
                    "restarts_in_window": len(w.restarts),
                    "given_up": w.given_up,
                    "retired": w.retired,
                }
                for iid, w in sorted(self.workers.items())
            },
        }

    async def reap(self, timeout_s: float = 15.0) -> None:
        """Wait for every process to exit (after a shutdown was sent); kill what does not."""
        for instance_id, w in self.workers.items():
            try:
                await asyncio.to_thread(w.proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("worker %s did not stop; killing pid %d", instance_id, w.proc.pid)
                w.proc.kill()
                await asyncio.to_thread(w.proc.wait)
        self.workers.clear()
