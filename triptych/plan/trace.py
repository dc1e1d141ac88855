"""Count what one call runs, on the meta device: its FLOPs (``torch.utils.flop_counter``) and the peak
of the bytes its intermediate tensors hold at once.

The peak is the high-water mark of the live outputs of every aten op the call dispatches (views of
another tensor are not counted again; a tensor leaves the count when Python frees it). Inputs and
parameters are not in it; nor are allocator rounding and kernel workspaces, so a device needs
somewhat more than it says."""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class Count:
    flops: int
    """Floating-point operations (a multiply-add is two)."""
    peak_bytes: int
    """The most bytes the call's intermediate tensors held at once (see the module's docstring)."""


class _LiveBytes(TorchDispatchMode):
    """Tracks the bytes of the op outputs alive now and the most seen at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        flat, _ = tree_flatten(out)
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                continue
            if i < len(returns) and returns[i].alias_info is not None:
                continue  # a view or an in-place result: its bytes are counted where they were made
            nbytes = t.numel() * t.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, nbytes)
        return out


def count(call: Callable[[], Any]) -> Count:
    """Run ``call`` (on meta tensors) under a FLOP counter and the live-bytes tracker."""
    flops = FlopCounterMode(display=False)
    live = _LiveBytes()
    with torch.no_grad(), flops, live:
        out = call()
    del out
    return Count(int(flops.get_total_flops()), live.peak)


def read_config(path: Path) -> dict[str, Any] | None:
    """A component's ``config.json``; None when it is missing."""
    return json.loads(path.read_text()) if path.is_file() else None


def meta_module(cls, config: dict[str, Any], dtype: torch.dtype = torch.bfloat16):
    """``cls`` built from ``config`` on the meta device (no weights), in ``dtype``. diffusers models
    take ``from_config``; transformers models their config class."""
    with torch.device("meta"), default_dtype(dtype):
        if hasattr(cls, "from_config") and not hasattr(cls, "config_class"):
            module = cls.from_config(config)
        else:
            module = cls._from_config(cls.config_class.from_dict(config), dtype=dtype)
    return module.eval()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Tensors made inside are ``dtype`` by default (the previous default restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def meta_like(t):
    """A meta tensor shaped like ``t`` (anything else as it is)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t
