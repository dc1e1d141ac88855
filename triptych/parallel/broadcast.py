"""Leader-to-ranks broadcasts for a multi-rank instance (each tick is decided on rank 0).

Nothing here pickles: a message travels as msgspec msgpack bytes in a uint8 tensor, tensors travel
as tensors after a msgspec header naming their dtypes and shapes (``core.tensors.TensorSpec`` by name). Every rank of the group calls the
same function in the same order; only the source passes the payload, the others pass ``None``.
On NCCL the transport tensors live on the rank's CUDA device (``ParallelGroups.device``).
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
import torch
import torch.distributed as dist

from triptych.core.tensors import TensorSpec
from triptych.parallel.groups import ParallelGroups

T = TypeVar("T")


def broadcast_bytes(payload: bytes | None, groups: ParallelGroups, src: int = 0) -> bytes:
    """``payload`` from global rank ``src`` to every rank of the instance (two broadcasts: length, bytes)."""
    is_src = groups.rank == src
    if is_src and payload is None:
        raise ValueError(f"rank {src} is the source and must pass the payload")
    length = torch.tensor([len(payload) if is_src else 0], dtype=torch.int64, device=groups.device)
    dist.broadcast(length, src=src, group=groups.world)
    if is_src:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(groups.device)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=groups.device)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=groups.world)
    return payload if is_src else bytes(buffer.cpu().numpy())


def broadcast_message(message: T | None, message_type: type[T], groups: ParallelGroups, src: int = 0) -> T:
    """A msgspec-encodable ``message`` (e.g. a tick description Struct) from rank ``src`` to every rank;
    each rank gets it decoded as ``message_type`` (the source gets its own object back)."""
    payload = msgspec.msgpack.encode(message) if groups.rank == src else None
    data = broadcast_bytes(payload, groups, src)
    return message if groups.rank == src else msgspec.msgpack.decode(data, type=message_type)


def broadcast_tensors(
    tensors: dict[str, torch.Tensor] | None, groups: ParallelGroups, src: int = 0
) -> dict[str, torch.Tensor]:
    """Named tensors from rank ``src`` to every rank, on each rank's device (the source's own tensors
    are returned as given). Use it for what only the leader received: conditioning, initial latents."""
    specs = None
    if groups.rank == src:
        specs = {k: TensorSpec.of(v) for k, v in tensors.items()}
    specs = broadcast_message(specs, dict[str, TensorSpec], groups, src)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if groups.rank == src:
            buffer = tensors[name].to(groups.device).contiguous()
        else:
            buffer = torch.empty(spec.shape, dtype=spec.torch_dtype, device=groups.device)
        dist.broadcast(buffer, src=src, group=groups.world)
        out[name] = tensors[name] if groups.rank == src else buffer
    return out
