"""``apply_parallel``: make a transformer and its rows forward run as one multi-rank instance.

A multi-rank denoiser runner (one instance; rank 0 talks to the head) runs, on every
rank::

    device = init_rank(rank, world_size, port, device="cuda", timeout=timedelta(seconds=60))
    groups = ParallelGroups.build(ParallelConfig(cfg=2, ulysses=2), device)  # a collective
    family = load_family(model_dir, roles={Role.DENOISER}, device=str(device))
    parallel = apply_parallel(family.pipe.transformer, groups)  # a collective
    forward = parallel.wrap(family.forward)
    while serving:
        tick = broadcast_message(decide_tick() if groups.is_leader else None, Tick, groups)
        for request_id in tick.joined:  # rank 0 holds what the head and the encoder sent
            task = broadcast_message(task if groups.is_leader else None, DenoiseTask, groups)
            flat = broadcast_tensors(cond.flat() if groups.is_leader else None, groups)
            states[request_id] = family.prepare(request_id, task.params, Conditioning.from_flat(flat))
        family.denoise_step([states[r] for r in tick.batch], fuse_cfg=True, forward=forward)
        # every rank now holds identical latents; rank 0 sends the finished ones

``prepare`` draws the initial noise from the request's seed, so every rank starts from the same
latents without sending them. Everything a rank does between two broadcasts must be the same on
all ranks (same rows, same order): a rank that diverges deadlocks the collectives until the
timeout, which takes the instance out of service.

TeaCache composes with the ranks itself: its forward runs the transformer in pieces (embed, block
stack, head) rather than through ``forward``, so ``Parallelism.for_cache`` gives it the points where
ranks meet (``triptych.parallel.cache``), and the engine hands it the wrapped forward for the
batches it does not touch.
"""

from __future__ import annotations

import torch

from triptych.parallel.cache import RanksForCache
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

    def for_cache(self) -> RanksForCache:
        """The composition TeaCache needs on this rank; raises ``ValueError`` for a model whose
        sequence split TeaCache's piecewise forward would bypass (see ``triptych.parallel.cache``)."""
        return RanksForCache(self.transformer, self.groups)

    def remove(self) -> None:
        if self._sequence is not None:
            self._sequence.remove()
            self._sequence = None


def apply_parallel(transformer: torch.nn.Module, groups: ParallelGroups) -> Parallelism:
    """Attach ``groups.config``'s parallelism to ``transformer``. A collective (diffusers sets up its
    context-parallel mesh): every rank of the instance calls it, before its first step."""
    return Parallelism(transformer, groups)
