"""The ranks of a multi-rank denoiser instance, seen from rank 0 (the worker process).

``InstanceRanks.start`` spawns ranks 1..N-1 (``python -m triptych.worker.ranks.follower``), forms the
instance's process group with them on a free loopback port (gloo on CPU, NCCL on CUDA; every
collective times out after ``collective_timeout_s``), builds the rank groups, tells the followers
what to load (the model, the adapters rank 0 serves, its quantization and compile settings), attaches
the parallelism to rank 0's transformer and, for a compiled served instance, warms every rank up
(``ranks/warmup.py``) before the worker registers. ``close`` tells them to stop (unless the group
broke), waits, and kills by pid whatever is left. Followers watch rank 0's pid and exit if it is gone.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys

from triptych.engine import EngineConfig
from triptych.parallel import ParallelConfig, ParallelGroups, apply_parallel, broadcast_message, destroy, free_port
from triptych.parallel import init_rank as join_group
from triptych.worker.ranks.follower import FollowerArgs, follower_argv
from triptych.worker.ranks.ticks import RankSetup, Tick
from triptych.worker.ranks.warmup import warm_up_ranks

logger = logging.getLogger(__name__)


class InstanceRanks:
    def __init__(self, parallel: ParallelConfig, collective_timeout_s: float, threads: int = 0):
        self.threads = threads
        self.parallel = parallel
        self.timeout_s = collective_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.groups: ParallelGroups | None = None
        self.parallelism = None
        self.warmup_counts: list[dict[str, int]] | None = None  # each rank's compile counters after the warm-up

    def start(
        self,
        family,
        model_dir: str,
        device: str,
        dtype: str | None,
        engine: EngineConfig,
        profiles_dir=None,
        warm_up: bool = False,
    ) -> ParallelGroups:
        """Spawn the followers, form the groups, send ``RankSetup``, attach the parallelism; with
        ``warm_up`` (a compiled family), every rank then warms up (``ranks/warmup.py``)."""
        world, port = self.parallel.world_size, free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        p = self.parallel
        for rank in range(1, world):
            args = FollowerArgs(
                rank=rank,
                world=world,
                port=port,
                parent_pid=os.getpid(),
                cfg=p.cfg,
                ulysses=p.ulysses,
                ring=p.ring,
                device=device,
                timeout=self.timeout_s,
                threads=self.threads,
            )
            cmd = [sys.executable, *follower_argv(args)]
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        logger.info("rank 0 of a %d-rank instance (%s); followers %s", world, p, [x.pid for x in self.procs])
        try:
            dev = join_group(0, world, port, device=device, timeout=datetime.timedelta(seconds=self.timeout_s))
            self.groups = ParallelGroups.build(p, dev)
            lora = family.lora.config if family.lora is not None else None  # followers serve the same adapters
            speed = family.speed  # the followers load their own transformer: quantized and compiled alike
            setup = RankSetup(
                str(model_dir),
                dtype,
                engine,
                p,
                profiles_dir and str(profiles_dir),
                lora,
                quantize=list(speed.quantize),
                compile=speed.compile,
                cuda_graphs=speed.cuda_graphs,
                compile_cache_dir=speed.compile_cache_dir and str(speed.compile_cache_dir),
                warm_up=warm_up and speed.compile,
            )
            broadcast_message(setup, RankSetup, self.groups)
            self.parallelism = apply_parallel(family.pipe.transformer, self.groups)
            if setup.warm_up:
                self.warmup_counts = warm_up_ranks(family, self.parallelism, self.groups)
        except BaseException:
            self.kill()
            raise
        return self.groups

    def close(self, broken: bool = False) -> None:
        """Tell the followers to stop, then make sure they are gone. ``broken``: a collective failed,
        so the group is not asked for another one (the followers are killed)."""
        if self.groups is not None and not broken:
            try:
                broadcast_message(Tick([], [], [], stop=True), Tick, self.groups)
            except Exception as e:  # noqa: BLE001 - a broken group: the followers are killed below
                logger.warning("could not tell the followers to stop: %s", e)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.kill()
        if self.parallelism is not None:
            self.parallelism.remove()  # the transformer is the single-rank one again
            self.parallelism = None
        self.groups = None
        destroy()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL to this pid only
                proc.wait()
