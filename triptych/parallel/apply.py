"""``apply_parallel``: make a transformer and its rows forward run as one multi-rank instance."""

from __future__ import annotations

import torch

from triptych.parallel.cfg import CfgParallel, RowsForward
from triptych.parallel.groups import ParallelGroups
from triptych.parallel.sequence import SequenceParallel


class Parallelism:
    """CFG and sequence parallel attached to one transformer, for one rank of the instance.

    Contract: after ``apply_parallel``, every rank runs ``family.denoise_step(states, fuse_cfg=True,
    forward=parallel.wrap(family.forward))`` on identical states (rank 0 decides the tick and
    broadcasts it, ``triptych.parallel.broadcast``), and every rank ends the step with identical
    latents, equal to the single-rank step within the stated tolerance. Each transformer call is a
    collective over the rank's sequence group, each wrapped forward one over its cfg group, so a rank
    that skips a step (or raises mid-step) stalls the others until the collective timeout: the
    instance then goes out of service as a whole. ``remove`` restores the transformer exactly.
    """

    def __init__(self, transformer: torch.nn.Module, groups: ParallelGroups):
        self.groups = groups
        self.transformer = transformer
        self._cfg = CfgParallel(groups)
        self._sequence = SequenceParallel(transformer, groups) if groups.config.sequence_degree > 1 else None

    def wrap(self, forward: RowsForward) -> RowsForward:
        """The rows forward to pass as ``denoise_step(..., forward=)`` (with ``fuse_cfg=True``, so both
        CFG branches reach one call and can be split). Wrap an acceleration's forward the same way."""
        return self._cfg.wrap(forward)

    def remove(self) -> None:
        if self._sequence is not None:
            self._sequence.remove()
            self._sequence = None


def apply_parallel(transformer: torch.nn.Module, groups: ParallelGroups) -> Parallelism:
    """Attach ``groups.config``'s parallelism to ``transformer``. A collective (diffusers sets up its
    context-parallel mesh): every rank of the instance calls it, before its first step."""
    return Parallelism(transformer, groups)
