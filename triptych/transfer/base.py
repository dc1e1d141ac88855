"""The transfer endpoint interface: one per instance, receiver and sender in one object.

Receiver side (owns buffers): `reserve` -> hand the `TensorRef` to the sender over the control
plane -> `wait_ready` returns the tensor and releases the slot. `release`/`cancel` free a slot
early; `reclaim_peer` frees every slot of a dead sender.
Sender side: `push(ref, tensor)` returns once the receiver acknowledged the bytes, or raises.
Only an endpoint built with the receiver's token can fill its slots (``capability``).
"""

from __future__ import annotations

import abc
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from triptych.transfer.errors import TransferError
from triptych.transfer.refs import TensorRef, TensorSpec, dtype_from_name
from triptych.transfer.slots import SlotPool
from triptych.transfer.stats import TransferStats


@dataclass(frozen=True)
class TransferConfig:
    """Configuration of one transfer endpoint."""

    host: str = "127.0.0.1"
    """Address this endpoint binds and advertises (ZMQ socket and Mooncake engine)."""
    max_slots: int = 64
    """Receiver slots: at most this many reservations live at once."""
    max_bytes: int = 256 << 20
    """Receiver bytes: the reserved tensors together never exceed this (Mooncake: arena size)."""
    push_timeout_s: float = 30.0
    """How long `push` waits for the receiver's acknowledgement before raising TransferTimeout."""
    poll_interval_s: float = 0.02
    """Receiver loop tick: the latency with which expired reservations are released."""
    staging_bytes: int = 16 << 20
    """Mooncake sender staging buffer; larger tensors are written in chunks of this size."""
    token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    """The deployment token the slots' capabilities derive from (``capability``): only endpoints
    built with the same token can fill each other's slots. Default: a fresh random one, so an
    endpoint built without the deployment's token talks only to endpoints sharing its config."""

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots={self.max_slots} must be >= 1")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes={self.max_bytes} must be >= 1")
        if self.push_timeout_s <= 0:
            raise ValueError(f"push_timeout_s={self.push_timeout_s} must be > 0")
        if not 0 < self.poll_interval_s <= 1.0:
            raise ValueError(f"poll_interval_s={self.poll_interval_s} must be in (0, 1]")
        if self.staging_bytes < 4096:
            raise ValueError(f"staging_bytes={self.staging_bytes} must be >= 4096")
        if len(self.token) < 16:
            raise ValueError("token must be the deployment token (at least 16 characters)")


class TransferEndpoint(abc.ABC):
    """One instance's end of the peer-to-peer tensor data plane.

    Ownership contract: a reserved slot (and its buffer) belongs to this receiver until
    `wait_ready` returns the tensor, or `release`, `cancel`, a timeout or `reclaim_peer` frees it;
    each of these frees it exactly once and wakes any waiter. The tensor `wait_ready` returns owns
    its storage; the receiver keeps no reference to it. A sender never holds receiver memory: a
    push after the slot was freed is rejected by the receiver and raises `TransferRejected`.
    """

    kind: str
    instance_id: str
    address: str  # "tcp://host:port" senders reach this receiver at
    pool: SlotPool
    stats: TransferStats

    # -- receiver ------------------------------------------------------------------------------
    @abc.abstractmethod
    def reserve(
        self,
        transfer_id: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        peer: str,
        timeout_s: float,
        request: str = "",
    ) -> TensorRef:
        """Reserve a slot that only `peer`, holding the slot's capability (bound to `request`), may
        fill within `timeout_s`; raises SlotUnavailable or DuplicateTransfer."""

    @abc.abstractmethod
    def wait_ready(self, transfer_id: str, timeout_s: float | None = None) -> torch.Tensor:
        """Block until the push arrived; return the tensor and release the slot. On a timeout
        (`timeout_s`, or the reservation deadline when None) the slot is released and
        TransferTimeout raised; TransferCancelled / PeerLost when freed by those paths."""

    @abc.abstractmethod
    def release(self, transfer_id: str) -> bool:
        """Free the slot without taking its tensor; False if it held none."""

    @abc.abstractmethod
    def cancel(self, transfer_id: str) -> bool:
        """Abort the transfer: free the slot, fail waiters and later pushes; False if none."""

    @abc.abstractmethod
    def reclaim_peer(self, peer: str) -> list[str]:
        """Free every slot reserved for the dead sender `peer`; returns their transfer ids."""

    # -- sender --------------------------------------------------------------------------------
    @abc.abstractmethod
    def push(self, ref: TensorRef, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        """Send `tensor` into the receiver slot `ref`; ValueError on a dtype/shape/nbytes
        mismatch (nothing sent), TransferRejected if the receiver refused it."""

    @abc.abstractmethod
    def idle(self) -> bool:
        """True when nothing is reserved and every buffer is free (the pool is at full capacity)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving, free every slot (waiters get TransferCancelled), release resources."""

    # -- bundles: several tensors of one request -------------------------------------------------
    def reserve_bundle(
        self, prefix: str, specs: Mapping[str, TensorSpec], peer: str, timeout_s: float, request: str = ""
    ) -> dict[str, TensorRef]:
        """Reserve one slot per named tensor (ids `prefix/name`); all or nothing."""
        refs: dict[str, TensorRef] = {}
        try:
            for name, spec in specs.items():
                dtype = dtype_from_name(spec.dtype)
                refs[name] = self.reserve(f"{prefix}/{name}", dtype, spec.shape, peer, timeout_s, request)
        except TransferError:
            for ref in refs.values():
                self.release(ref.transfer_id)
            raise
        return refs

    def wait_bundle(self, refs: Mapping[str, TensorRef], timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Wait for every tensor of a bundle; on any failure the remaining slots are released."""
        out: dict[str, torch.Tensor] = {}
        try:
            for name, ref in refs.items():
                out[name] = self.wait_ready(ref.transfer_id, timeout_s)
        except TransferError:
            for name, ref in refs.items():
                if name not in out:
                    self.release(ref.transfer_id)
            raise
        return out

    def push_bundle(
        self,
        refs: Mapping[str, TensorRef],
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float | None = None,
    ) -> None:
        """Push every named tensor into its ref; the names must match exactly."""
        if set(refs) != set(tensors):
            raise ValueError(f"bundle names differ: refs {sorted(refs)} vs tensors {sorted(tensors)}")
        for name, ref in refs.items():
            self.push(ref, tensors[name], timeout_s)


def bundle_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The specs to reserve for a dict of tensors."""
    return {name: TensorSpec.of(t) for name, t in tensors.items()}
