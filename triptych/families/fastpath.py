"""Checks the families' fast forwards (``families/<family>/fast.py``) share: when the model's own
forward must run instead, and whether copies of its weights still hold (``Stamp``)."""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

# NOTE: torch has no public API that lists a module's hooks or gives a tensor's version counter, and
# its public parameter access (``Module.__getattr__``) raises and catches an ``AttributeError`` per
# parameter: the private reads every fast path's staleness check needs are these two helpers only.


def hooked(m: torch.nn.Module, idle: frozenset[int] = frozenset()) -> bool:
    """Whether calling ``m``'s weights directly would skip a hook: any pre-hook, or a forward hook
    other than the ``idle`` ones (the LoRA runtime's, which add nothing when no row has an adapter)."""
    return bool(m._forward_pre_hooks) or any(k not in idle for k in m._forward_hooks)


def diffusers_hooked(module: torch.nn.Module) -> bool:
    """Whether diffusers' hook registry on ``module`` holds a hook (context parallel, caches, offload).
    A pipeline's ``__call__`` leaves an empty registry behind (``cache_context``): that one is idle.
    The registry is a plain attribute (in the module's ``__dict__``); read there, a module without
    one costs a dict look-up, not ``Module.__getattr__``'s raised and caught ``AttributeError``."""
    registry = module.__dict__.get("_diffusers_hook")
    return registry is not None and bool(registry.hooks)


def model_hooked(module: torch.nn.Module) -> bool:
    """A torch hook on ``module``, or a diffusers hook on it, its children or theirs (where diffusers'
    context-parallel plans, caches and offloading put them: the model, ``pos_embed``, each block):
    a hook expects the model's forward to run. Checked every forward, so not deeper."""
    if hooked(module) or diffusers_hooked(module):
        return True
    for child in module.children():
        if diffusers_hooked(child) or any(diffusers_hooked(c) for c in child.children()):
            return True
    return False


def native_attention(processor) -> bool:
    """The processor dispatches to diffusers' native SDPA backend without a parallel config."""
    backend = processor._attention_backend
    if backend is None:
        backend = _AttentionBackendRegistry.get_active_backend()[0]
    return backend in (AttentionBackendName.NATIVE, "native") and processor._parallel_config is None


class Stamp:
    """What a fast path's copies of a model's weights were made from: the parameters of ``owners``
    ((module, name); absent ones too, since one added is a change) as objects and versions (a weight
    replaced, or changed in place, changes one or the other) and the ``hooked`` verdicts of the
    modules it calls through their weights. ``holds`` is the one check per forward."""

    def __init__(self, owners, bypassed, idle: frozenset[int]):
        self.owners = [(m._parameters, name) for m, name in owners]
        self.params = [d.get(name) for d, name in self.owners]
        self.present = [p for p in self.params if p is not None]
        self.versions = [p._version for p in self.present]
        self.hooks = [(m._forward_pre_hooks, m._forward_hooks) for m in bypassed]
        self.verdicts = self._verdicts(idle)

    def _verdicts(self, idle: frozenset[int]) -> list[bool]:
        return [bool(pre) or (bool(post) and any(k not in idle for k in post)) for pre, post in self.hooks]

    def holds(self, idle: frozenset[int]) -> bool:
        """Whether nothing recorded changed (``idle``: the hooks that add nothing now)."""
        if self._verdicts(idle) != self.verdicts:
            return False
        if not all(d.get(name) is p for (d, name), p in zip(self.owners, self.params)):
            return False
        return [p._version for p in self.present] == self.versions
