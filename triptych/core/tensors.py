"""A tensor's dtype and shape as plain data: the one ``TensorSpec`` every layer speaks.

A receiver reserves transfer slots from specs (``transfer``), the head passes them in control
messages (``control.protocol``), and a multi-rank instance's rank 0 broadcasts them ahead of the
tensors themselves (``parallel.broadcast``). Dtypes travel by their torch attribute name
(``"bfloat16"``) from a closed table: an unknown dtype raises instead of guessing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

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
    """Dtype and shape of one tensor (the tensor itself stays put)."""

    dtype: str  # wire dtype name (``dtype_name``)
    shape: tuple[int, ...]  # contiguous shape

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)
