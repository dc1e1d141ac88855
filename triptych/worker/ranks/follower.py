"""A follower rank of a multi-rank denoiser instance: ``python -m triptych.worker.ranks.follower ...``.

Spawned by rank 0 (``ranks/instance.py``), never by a user. It joins the instance's process group,
learns what to load from rank 0 (``RankSetup``), loads the denoiser's components quantized and
compiled as rank 0's (and serves rank 0's LoRA adapters, if any), attaches the parallelism, warms up
with every other rank when rank 0 says so (``ranks/warmup.py``), and applies rank 0's ticks
(``ranks/ticks.follow``) until told to stop. It never
talks to the head. It exits when rank 0's process is gone or a collective fails (a dead or hung
peer): the instance leaves service as a whole.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from triptych.core.config_flags import ConfigFlags, argv_of

logger = logging.getLogger("triptych.worker.ranks.follower")


@dataclass(frozen=True)
class FollowerArgs:
    """What rank 0 gives a follower on its command line (``follower_argv``); the rest comes in
    ``RankSetup`` once the process group formed."""

    rank: int
    """This follower's rank (1 .. world - 1)."""
    world: int
    """Ranks of the instance."""
    port: int
    """Rank 0's rendezvous port (loopback)."""
    parent_pid: int
    """Rank 0's pid: the follower exits when it is gone."""
    cfg: int
    """CFG-parallel degree."""
    ulysses: int
    """Ulysses degree."""
    ring: int
    """Ring degree."""
    device: str = "cpu"
    """Device of this rank."""
    timeout: float = 60.0
    """Collective timeout (seconds): a rank waiting on a dead peer fails instead of hanging."""
    threads: int = 0
    """torch threads (0 = torch's default)."""


def follower_argv(args: FollowerArgs) -> list[str]:
    """The command that starts a follower with ``args`` (parsed back by ``main``)."""
    return ["-m", "triptych.worker.ranks.follower", *argv_of(FollowerArgs, args)]


def parse_args(argv: list[str] | None) -> FollowerArgs:
    p = argparse.ArgumentParser(prog="triptych.worker.ranks.follower")
    flags = ConfigFlags(p, FollowerArgs)
    return flags.build(p.parse_args(argv), p)


def _watch_parent(pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != pid:
            logger.error("rank 0 (pid %d) is gone; exiting", pid)
            os._exit(4)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from triptych.core.kinds import Role
    from triptych.families.registry import family_class
    from triptych.parallel import ParallelConfig, ParallelGroups, apply_parallel, broadcast_message, destroy, init_rank
    from triptych.worker.ranks.ticks import RankSetup, follow, instance_engine

    timeout = datetime.timedelta(seconds=args.timeout)
    device = init_rank(args.rank, args.world, args.port, device=args.device, timeout=timeout)
    try:
        groups = ParallelGroups.build(ParallelConfig(cfg=args.cfg, ulysses=args.ulysses, ring=args.ring), device)
        setup = broadcast_message(None, RankSetup, groups)
        from triptych.accel import SpeedConfig

        cache_dir = Path(setup.compile_cache_dir) if setup.compile_cache_dir else None
        speed = SpeedConfig(
            compile=setup.compile,
            cuda_graphs=setup.cuda_graphs,
            compile_cache_dir=cache_dir,
            quantize=tuple(setup.quantize),
        )
        family = family_class(setup.model_dir)(
            setup.model_dir, roles={Role.DENOISER}, device=str(device), dtype=setup.dtype, speed=speed
        )
        if setup.lora is not None:  # rank 0's adapters, read from the same files under the same budget
            family.enable_lora(setup.lora)
        parallelism = apply_parallel(family.pipe.transformer, groups)
        if setup.warm_up:
            from triptych.worker.ranks.warmup import warm_up_ranks

            warm_up_ranks(family, parallelism, groups)
        engine = instance_engine(family, setup.engine, parallelism, setup.teacache_profiles_dir)
        follow(family, engine, groups)
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
