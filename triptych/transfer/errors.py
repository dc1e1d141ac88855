"""Errors of the transfer data plane. All derive from `TransferError`."""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base class for every transfer failure."""


class SlotUnavailable(TransferError):
    """The receiver pool has no free slot or not enough free bytes; retry later or fail."""


class DuplicateTransfer(TransferError):
    """The transfer id is in use or was used recently; ids must be unique."""


class UnknownTransfer(TransferError, KeyError):
    """No live reservation has this transfer id (never reserved, or already released)."""


class TransferTimeout(TransferError, TimeoutError):
    """The reservation's deadline or a wait timed out; the slot has been released."""


class TransferCancelled(TransferError):
    """The reservation was cancelled by the receiver; the slot has been released."""


class PeerLost(TransferError):
    """The sending peer was declared dead; its slots have been reclaimed."""


class TransferRejected(TransferError):
    """The receiver refused a push (no valid capability, unreserved, duplicate, wrong size, wrong
    sender, expired)."""


class BackendUnavailable(TransferError):
    """A backend cannot run here (library missing or its engine failed to initialize)."""
