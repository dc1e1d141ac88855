"""Tensor handles that travel beside typed control messages, and dtype helpers.

A `TensorRef` is what a receiver hands a sender after reserving a slot: everything the sender needs
to push one tensor, and nothing else. It is small, frozen and msgspec-encodable; the tensor bytes
never travel inside it. ``TensorSpec`` and the dtype helpers are ``core.tensors``' (one spec for the
transfers, the control messages and the multi-rank broadcasts).
"""

from __future__ import annotations

import msgspec
import torch

from triptych.core.tensors import TensorSpec, dtype_from_name, dtype_name, tensor_nbytes

__all__ = [
    "TensorRef",
    "TensorSpec",
    "MooncakeLocation",
    "check_tensor",
    "dtype_from_name",
    "dtype_name",
    "tensor_nbytes",
]


class MooncakeLocation(msgspec.Struct, frozen=True):
    """Where a Mooncake sender writes the bytes of one slot."""

    session: str  # receiver TransferEngine session id, "host:rpc_port"
    remote_addr: int  # receiver virtual address of the slot's buffer (inside its registered arena)


class TensorRef(msgspec.Struct, frozen=True):
    """Handle to one reserved receiver slot; the sender pushes exactly this tensor into it."""

    transfer_id: str  # unique per transfer; a duplicate is rejected by the receiver
    dtype: str  # wire dtype name, see `dtype_name`
    shape: tuple[int, ...]  # contiguous shape of the tensor
    nbytes: int  # bytes of the tensor = prod(shape) * itemsize
    owner: str  # instance id of the receiver that holds the slot
    slot: int  # slot index in the owner's pool (for logs and stats; the id is the key)
    endpoint: str  # owner's ZMQ control/data address, "tcp://host:port"
    mooncake: MooncakeLocation | None  # write target for the Mooncake backend; None for ZMQ-only
    request: str = ""  # the request the slot serves; bound into the slot's capability (``capability``)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


def check_tensor(ref: TensorRef, tensor: torch.Tensor) -> None:
    """Raise ValueError unless `tensor` matches the dtype, shape and byte count `ref` reserved."""
    name = dtype_name(tensor.dtype)
    if name != ref.dtype:
        raise ValueError(f"transfer {ref.transfer_id}: dtype {name} != reserved {ref.dtype}")
    if tuple(tensor.shape) != tuple(ref.shape):
        raise ValueError(f"transfer {ref.transfer_id}: shape {tuple(tensor.shape)} != reserved {ref.shape}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != ref.nbytes:
        raise ValueError(f"transfer {ref.transfer_id}: {nbytes} bytes != reserved {ref.nbytes}")


_REF_ENCODER = msgspec.msgpack.Encoder()
_REF_DECODER = msgspec.msgpack.Decoder(TensorRef)


def encode_ref(ref: TensorRef) -> bytes:
    return _REF_ENCODER.encode(ref)


def decode_ref(data: bytes) -> TensorRef:
    return _REF_DECODER.decode(data)
