"""What the fast path's copies of a model's weights were made from, checked at every forward.

The fused q/k/v, the transposed copies and the compiled stack's arena (``fast_block.BlockPlan``,
``fast_stack.FrozenStack``) are copies: they hold while every parameter they were made from is the
same object at the same version (a weight replaced, or changed in place, bumps one or the other) and
no linear they bypass has gained a hook. ``Watch`` records that state once and ``holds`` checks it as
three flat comprehensions: a stack's watch is the union of its blocks' and its head's, one check per
forward instead of one call per block and per copy (the objects it reads are out of the cache after
the stack's weight pass, so fewer Python frames around them count).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


def hooked(m, idle: frozenset[int] = frozenset()) -> bool:
    """Whether calling ``m``'s weights directly would skip a hook: any pre-hook, or a forward hook
    other than the ``idle`` ones (the LoRA runtime's, which add nothing when no row has an adapter)."""
    return bool(m._forward_pre_hooks) or any(k not in idle for k in m._forward_hooks)


@dataclass
class Watch:
    """Parameters by owner and name, their objects and versions, and the hook dicts of modules called
    through their weights (``hooked``), as they were when the copies were made."""

    hooks: list[tuple[torch.nn.Module, dict, dict]]
    owners: list[tuple[dict, str]]
    params: list[torch.Tensor | None]  # per owner: None where it has no such parameter (a bias-free linear)
    present: list[torch.Tensor]  # the params that exist
    versions: list[int]  # theirs

    @classmethod
    def of(cls, bypassed: Iterable[torch.nn.Module], owners: Sequence[tuple[torch.nn.Module, str]]) -> Watch:
        """The current state of ``owners``' parameters (absent ones too: one added is a change) and
        ``bypassed``'s hooks."""
        held = [(m._parameters, name) for m, name in owners]
        params = [owner.get(name) for owner, name in held]
        present = [p for p in params if p is not None]
        hooks = [(m, m._forward_pre_hooks, m._forward_hooks) for m in bypassed]
        return cls(hooks, held, params, present, [p._version for p in present])

    @classmethod
    def union(cls, watches: Iterable[Watch]) -> Watch:
        out = cls([], [], [], [], [])
        for w in watches:
            out.hooks += w.hooks
            out.owners += w.owners
            out.params += w.params
            out.present += w.present
            out.versions += w.versions
        return out

    def holds(self, idle: frozenset[int]) -> bool:
        """Whether nothing recorded changed: no hook added (other than ``idle`` ones), the same
        parameter objects, at the same versions."""
        if any(pre or (post and hooked(m, idle)) for m, pre, post in self.hooks):
            return False
        if not all(owner.get(name) is p for (owner, name), p in zip(self.owners, self.params)):
            return False
        return [p._version for p in self.present] == self.versions
