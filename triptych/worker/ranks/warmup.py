"""The warm-up of a compiled multi-rank denoiser instance: every rank compiles before rank 0 registers.

When rank 0's ``RankSetup.warm_up`` says so (a served instance with ``--compile``), rank 0
(``InstanceRanks.start``) and every follower (``ranks/follower.py``) call ``warm_up_ranks`` right
after the parallelism is attached: each runs ``engine.warmup.warm_up`` through the instance's rows
forward (``Parallelism.wrap``: CFG parallel splits the rows, sequence parallel lives inside the
transformer), so every rank runs the same forwards in the same order and their collectives meet.
One all-gather then gives every rank the compile counters of each rank; rank 0 logs and keeps them.

Each rank compiles a graph at its first call while its peers wait for it in the next collective,
so the collective timeout (``--collective-timeout``) must exceed how far one rank's compile runs
behind another's (the ranks compile the same graphs at the same time).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from triptych.engine.warmup import warm_up
from triptych.parallel import ParallelGroups

logger = logging.getLogger(__name__)

COUNTERS = ("unique_graphs", "recompiles")


def warm_up_ranks(family, parallelism, groups: ParallelGroups) -> list[dict[str, int]] | None:
    """Every rank at once: warm ``family`` up through ``parallelism``'s forward; returns each rank's
    compile counters after it (rank order), or None when the family has no warm-up inputs (the same
    on every rank: they load the same model, so no collective runs then either)."""
    counts = warm_up(family, forward=parallelism.wrap(family.forward))
    if counts is None:
        return None
    mine = torch.tensor([counts[k] for k in COUNTERS], dtype=torch.int64, device=groups.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(groups.world))]
    dist.all_gather(every, mine, group=groups.world)
    out = [dict(zip(COUNTERS, t.tolist())) for t in every]
    if groups.rank == 0:
        logger.info("every rank warmed up: %s", ", ".join(f"rank {i} {c}" for i, c in enumerate(out)))
    return out
