"""Staging between device memory and the host buffers transfers send from and receive into.

A sender's stage output may live on a GPU; the transfer backends move host memory. ``to_host`` copies
device tensors into pinned (page-locked) host memory, so the copy is a DMA the CPU does not drive and
all of one call's copies queue back to back (``non_blocking``) before a single synchronize. A
receiver's tensors arrive in host memory; ``to_device`` puts them on the stage's device (and dtype).

Ownership: ``to_host`` returns new host tensors the caller owns (CPU inputs come back as the same
objects, no copy). ``to_device`` synchronizes before returning when it copied from pinned memory
without blocking, so the caller may release or reuse the source buffers (e.g. a transfer slot) at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor in host memory: device tensors copied into pinned buffers, CPU tensors untouched."""
    out: dict[str, torch.Tensor] = {}
    pending: set[torch.device] = set()
    for name, tensor in tensors.items():
        if tensor.device.type == "cpu":
            out[name] = tensor
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        host.copy_(tensor, non_blocking=host.is_pinned())
        if host.is_pinned():
            pending.add(tensor.device)
        out[name] = host
    for device in pending:
        torch.cuda.synchronize(device)
    return out


def to_device(
    tensors: Mapping[str, torch.Tensor], device: str | torch.device, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor on ``device``; floating-point tensors also cast to ``dtype`` when given (integer
    tensors such as shapes and ids keep theirs). A tensor already on the device in its dtype is
    returned as is."""
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    pending = False
    for name, tensor in tensors.items():
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        fast = device.type == "cuda" and tensor.device.type == "cpu" and tensor.is_pinned()
        out[name] = tensor.to(device=device, dtype=target, non_blocking=fast)
        pending = pending or fast
    if pending:
        torch.cuda.synchronize(device)
    return out
