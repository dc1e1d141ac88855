"""Tensor handles that travel beside typed control messages, and dtype helpers.

A `TensorRef` is what a receiver hands a sender after reserving a slot: everything the sender needs
to push one tensor, and nothing else. It is small, frozen and msgspec-encodable; the tensor bytes
never travel inside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

# NOTE: names are the torch attribute names, so `getattr(torch, name)` round-trips; the table is
# closed on purpose: an unknown dtype raises instead of guessing.
_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be transferred; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(_DTYPES)}") from None


def tensor_nbytes(dtype: torch.dtype | str, shape: Sequence[int]) -> int:
    """Bytes of a contiguous tensor of this dtype and shape."""
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    if any(int(d) < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative dimension")
    return math.prod(int(d) for d in shape) * dtype.itemsize


class TensorSpec(msgspec.Struct, frozen=True):
    """Dtype and shape of one tensor a receiver must reserve (the tensor itself stays put)."""

    dtype: str  # wire dtype name (``dtype_name``)
    shape: tuple[int, ...]  # contiguous shape

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(tensor.dtype), tuple(tensor.shape))


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
