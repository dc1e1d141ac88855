"""Small helpers shared by tests: PSNR, transformer call counting."""

from __future__ import annotations

import contextlib

import numpy as np


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two float arrays in [0, 1] (inf when identical)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


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
