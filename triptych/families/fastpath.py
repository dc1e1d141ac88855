"""Checks the families' fast forwards (``pipelines/<family>/fast.py``) share: when the model's own
forward must run instead."""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry


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
    if module._forward_hooks or module._forward_pre_hooks or diffusers_hooked(module):
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
