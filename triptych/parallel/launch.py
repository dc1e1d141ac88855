"""Run a function on N local ranks (forked processes, loopback rendezvous on a free port).

For tests, benchmarks and one-shot multi-rank runs. Every process started here is joined, and
killed by its pid if it outlives the deadline or a sibling failed; nothing is left running.

The ranks are forked from ``multiprocessing``'s fork server (one per launching process, started at
the first ``run_ranks``), which imports ``PRELOAD`` once: a rank then starts without importing
torch, diffusers and transformers again. The fork server is a fresh interpreter with no threads, so
forking it is safe, CUDA included (it never initialises CUDA). A rank gets the launcher's
environment as it is at the call; variables torch reads at its import are the fork server's.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from triptych.parallel.groups import destroy, free_port, init_rank

#: imported once by the ranks' fork server
PRELOAD = ["torch", "torch.distributed", "triptych.parallel"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class RankFailed(RuntimeError):
    """One or more ranks raised, died or timed out; the message carries each failed rank's story."""


def _rank_main(
    fn, rank: int, world_size: int, port: int, device: str, timeout_s: float, args, out_dir: str, env: dict
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the launcher's, not the fork server's
    out = Path(out_dir)
    try:
        dev = init_rank(rank, world_size, port, device=device, timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, dev, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        destroy()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    device: str = "cpu",
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """``fn(rank, device, *args)`` on ``world_size`` spawned ranks; returns each rank's return value.

    ``fn`` must be importable (module level) and return tensors, numbers, strings, lists and dicts
    (saved with ``torch.save``, loaded with ``weights_only=True``). Raises ``RankFailed`` if any rank
    raises, dies, or the whole run exceeds ``timeout_s``; collectives time out after
    ``collective_timeout_s``, so a rank waiting on a dead peer fails instead of hanging.
    """
    ctx = _context()
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="triptych-ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, device, collective_timeout_s, args, out_dir, env),
                name=f"triptych-rank{rank}",
            )
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank failed: its peers would wait for it until the collective timeout
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.pid is None:
                    continue  # never started (a sibling's start raised)
                if p.is_alive():
                    p.kill()  # SIGKILL to this pid only
                p.join()
        out = Path(out_dir)
        problems = []
        for rank, p in enumerate(procs):
            err = out / f"rank{rank}.err"
            if err.exists():
                problems.append(f"rank {rank} raised:\n{err.read_text()}")
            elif p.exitcode != 0:
                problems.append(f"rank {rank} exited with {p.exitcode} (killed after the deadline or a peer's failure)")
        if problems:
            raise RankFailed("\n".join(problems))
        return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]
