"""TeaCache on a multi-rank instance: where its pieces meet the instance's ranks.

TeaCache (``triptych.accel.teacache``) runs a transformer as ``embed`` → per-row skip decision →
block stack on the rows that compute → ``head``. On a multi-rank instance every rank runs that same
forward on the same rows (the tick is broadcast), and :class:`RanksForCache` supplies the three
points where ranks meet:

- **Decisions, once.** Every rank computes the modulated input of every row (``embed`` runs on all
  rows, unsplit) and so could decide alone; the leader's decisions and accumulated values are
  broadcast over the instance group anyway (one small tensor per step) and adopted, so the ranks
  can never skip different rows, even where two devices round differently.
- **CFG parallel** splits the rows of the *block stack* (the part TeaCache does not skip), not the
  rows of the forward: the computing rows are cut into contiguous parts, CFG group ``i`` runs part
  ``i``, one all-gather gives every rank every computing row. Every rank therefore holds the state
  of every row (decision inputs and residuals), whatever the batch composition, and the rows of a
  request may move between CFG groups from one step to the next.
- **Sequence parallel** is diffusers' context parallel, attached to the transformer: a model whose
  ``_cp_plan`` splits the tokens at its first block (Qwen-Image: ``transformer_blocks.0``; Wan:
  ``blocks.0``) splits them when TeaCache calls the block stack, and gathers them at ``proj_out``
  when it calls the head. The block stack's output is this rank's shard of the tokens, so the cached
  residual is the shard too; ``local`` gives the matching shard of the block stack's input (the same
  split function the block's hook calls). A model that splits its tokens at the forward's own inputs
  (FLUX: ``""``) is not reached by TeaCache's piecewise forward: ``RanksForCache`` refuses it.

Worked example (cfg=2 × ulysses=2, 4 ranks, a batch of 3 requests with CFG = 6 rows, TeaCache skips
rows 1 and 4 this step): the leader's decisions ``[c, s, c, c, s, c]`` reach every rank; the
computing rows ``[0, 2, 3, 5]`` split into ``[0, 2]`` (CFG group 0: ranks 0, 1) and ``[3, 5]`` (group
1: ranks 2, 3); inside a group the two ranks each hold half the tokens of its two rows (Ulysses);
the all-gather over the CFG group gives ranks 0 and 2 the first token half of rows ``[0, 2, 3, 5]``
and ranks 1 and 3 the second half; rows 1 and 4 add their cached residual shard; ``head`` gathers
the token halves (``proj_out``), so every rank ends with the predictions of all six rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from diffusers.hooks.context_parallel import (
    _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE,
    ContextParallelSplitHook,
    _get_submodule_by_name,
)

from triptych.parallel.cfg import split_rows
from triptych.parallel.groups import ParallelGroups


def _block_input_split(transformer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The split the transformer's context-parallel hooks apply to its block stack's ``hidden_states``.

    NOTE: calls the hook's ``_prepare_cp_input`` (diffusers 0.42.1, private) so the shard is the one
    the block sees by construction, uneven ("anything") splits included.
    """
    for module_id, entry in transformer._cp_plan.items():
        if not isinstance(entry, dict) or "hidden_states" not in entry:
            continue
        if module_id == "":
            raise ValueError(
                f"{type(transformer).__name__} splits its tokens at its forward's inputs, which TeaCache's "
                "piecewise forward does not pass through: TeaCache cannot run on its sequence-parallel instance"
            )
        module = _get_submodule_by_name(transformer, module_id)
        registry = HookRegistry.check_if_exists_or_initialize(module)
        hook = registry.get_hook(_CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE.format(module_id))
        if not isinstance(hook, ContextParallelSplitHook):
            raise ValueError(f"{module_id}: no context-parallel split hook attached (enable_parallelism first)")
        cp_input = entry["hidden_states"]
        return lambda hidden: hook._prepare_cp_input(hidden, cp_input)
    raise ValueError(f"{type(transformer).__name__}'s _cp_plan splits no block input named hidden_states")


class RanksForCache:
    """A ``triptych.accel.teacache.RankComposition`` for one rank of an instance (see module docstring).

    Build it after ``apply_parallel`` (the split hooks must be attached), on every rank.
    """

    def __init__(self, transformer: torch.nn.Module, groups: ParallelGroups):
        self.groups = groups
        self._split = _block_input_split(transformer) if groups.config.sequence_degree > 1 else None

    def local(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self._split is None else self._split(hidden)

    def agree(self, compute: list[bool], accumulated: list[float]) -> tuple[list[bool], list[float]]:
        g = self.groups
        values = torch.tensor([float(c) for c in compute] + accumulated, dtype=torch.float64)
        values = values.to(g.device)
        dist.broadcast(values, src=0, group=g.world)
        values = values.cpu().tolist()
        n = len(compute)
        return [v != 0.0 for v in values[:n]], values[n:]

    def blocks(self, run: Callable[[list[int]], torch.Tensor], idx: list[int]) -> torch.Tensor:
        if self.groups.config.cfg == 1 or len(idx) < self.groups.config.cfg:
            return run(idx)
        return split_rows(idx, run, self.groups)
