"""CFG parallel: the rows of one fused forward computed by separate rank groups, joined by one all-gather.

A fused denoiser forward stacks one row per (request, CFG branch), cond rows first, then uncond
rows. With ``cfg=2`` the rows are cut into two contiguous halves (sizes differ by at most one):
when every request of the batch has CFG that is exactly cond rows | uncond rows. CFG half ``i``
runs the base forward on its half (itself sequence parallel across its sequence group when
ulysses/ring > 1), pads its output to the larger half's row count, and one ``all_gather`` over
the cfg group gives every rank every row, in the original order.

A forward with fewer rows than halves (one request without CFG, e.g. FLUX with distilled guidance)
has nothing to split: every rank computes all of it and no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from triptych.parallel.groups import ParallelGroups

RowT = TypeVar("RowT")
RowsForward = Callable[[Sequence[RowT]], torch.Tensor]


def split_bounds(rows: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous slices of ``rows`` (the first ``rows % parts`` one longer)."""
    base, extra = divmod(rows, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class CfgParallel:
    """Wraps a rows → predictions forward (``Family.forward``, or an acceleration around it).

    Contract: every rank of the instance calls the wrapped forward with the same rows in the same
    order (the tick is decided on rank 0 and broadcast); each gets the predictions of all rows.
    """

    def __init__(self, groups: ParallelGroups):
        self.groups = groups
        self.degree = groups.config.cfg

    def wrap(self, forward: RowsForward) -> RowsForward:
        if self.degree == 1:
            return forward

        def cfg_parallel_forward(rows: Sequence[RowT]) -> torch.Tensor:
            return self.run(forward, rows)

        return cfg_parallel_forward

    def run(self, forward: RowsForward, rows: Sequence[RowT]) -> torch.Tensor:
        if len(rows) < self.degree:
            return forward(rows)
        return split_rows(rows, forward, self.groups)


def split_rows(rows: Sequence[RowT], compute: Callable[[Sequence[RowT]], torch.Tensor], groups) -> torch.Tensor:
    """``compute(rows)`` with the rows cut into ``groups.config.cfg`` contiguous parts, part ``i``
    computed by CFG group ``i``, and one all-gather over the CFG group: every rank gets every row."""
    degree = groups.config.cfg
    bounds = split_bounds(len(rows), degree)
    index = groups.cfg_index
    mine = compute(rows[bounds[index] : bounds[index + 1]]).contiguous()
    longest = bounds[1] - bounds[0]
    if mine.shape[0] < longest:
        mine = torch.cat([mine, mine.new_zeros(longest - mine.shape[0], *mine.shape[1:])])
    gathered = [torch.empty_like(mine) for _ in range(degree)]
    dist.all_gather(gathered, mine, group=groups.cfg_group)
    return torch.cat([g[: bounds[i + 1] - bounds[i]] for i, g in enumerate(gathered)])
