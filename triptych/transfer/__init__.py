"""Peer-to-peer tensor data plane: receiver slot pools and the ZMQ / Mooncake backends.

Tensors move instance to instance; only `TensorRef` handles travel in control messages.
"""

from triptych.transfer.base import TensorSpec, TransferConfig, TransferEndpoint, bundle_specs
from triptych.transfer.errors import (
    BackendUnavailable,
    DuplicateTransfer,
    PeerLost,
    SlotUnavailable,
    TransferCancelled,
    TransferError,
    TransferRejected,
    TransferTimeout,
    UnknownTransfer,
)
from triptych.transfer.factory import make_endpoint, mooncake_available
from triptych.transfer.refs import (
    MooncakeLocation,
    TensorRef,
    decode_ref,
    dtype_from_name,
    dtype_name,
    encode_ref,
    tensor_nbytes,
)
from triptych.transfer.slots import Slot, SlotPool, SlotState
from triptych.transfer.stats import TransferStats

__all__ = [
    "BackendUnavailable",
    "DuplicateTransfer",
    "MooncakeLocation",
    "PeerLost",
    "Slot",
    "SlotPool",
    "SlotState",
    "SlotUnavailable",
    "TensorRef",
    "TensorSpec",
    "TransferCancelled",
    "TransferConfig",
    "TransferEndpoint",
    "TransferError",
    "TransferRejected",
    "TransferStats",
    "TransferTimeout",
    "UnknownTransfer",
    "bundle_specs",
    "decode_ref",
    "dtype_from_name",
    "dtype_name",
    "encode_ref",
    "make_endpoint",
    "mooncake_available",
    "tensor_nbytes",
]
