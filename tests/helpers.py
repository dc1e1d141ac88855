"""Small helpers shared by tests: transformer call counting."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def count_calls(module):
    """Count forward calls of ``module`` (and the batch size of each)."""
    calls: list[int] = []

    def hook(mod, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        calls.append(int(hs.shape[0]))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
