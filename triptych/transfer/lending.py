"""The serving end of a fetch: an endpoint pushes a tensor it lends into a slot the asker reserved.

A peer that wants a tensor this instance holds (an encoder's vision-tower embedding, by mm-hash)
reserves a slot on its own endpoint for this instance and sends a ``FetchRequest`` naming the key
and the slot. ``Lending.lend`` (called on the endpoint's serving thread) asks the ``Lender`` for the
tensor under a loan id, acks at once, and pushes from a thread of its own, so the serving thread
never waits on a peer.

Ownership contract: the lender keeps the lent entry alive (a reference on it, nothing evicts it)
from ``lend`` until ``give_back(loan)``, which ``Lending`` calls exactly once per loan it took:
after the push completed, failed or timed out (the push's own ack timeout bounds it). At most
``most`` loans run at once; a request past that is refused (the asker computes instead).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import torch

from triptych.transfer.errors import TransferError
from triptych.transfer.messages import FetchRequest
from triptych.transfer.refs import TensorRef

logger = logging.getLogger(__name__)


class Lender(Protocol):
    def lend(self, key: str, ref: TensorRef, loan: str) -> torch.Tensor | str:
        """The tensor under ``key`` matching ``ref``'s dtype and shape, referenced for ``loan`` until
        ``give_back``; or why not (a short reason sent back to the asker)."""

    def give_back(self, loan: str, pushed: bool) -> None:
        """The loan is over (``pushed``: the asker got the bytes); drop its reference."""


class Lending:
    def __init__(self, lender: Lender, push, most: int = 8):
        """``push(ref, tensor)``: the endpoint's own push (raises ``TransferError`` on failure)."""
        self.lender = lender
        self.push = push
        self.most = most
        self._running = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """Loans whose push has not ended yet."""
        with self._lock:
            return self._running

    def lend(self, msg: FetchRequest) -> str | None:
        """Start the push for ``msg``; None (ack) or the refusal's reason."""
        if msg.ref.transfer_id != msg.transfer_id or msg.ref.owner != msg.sender:
            return f"{msg.transfer_id!r}: the ref is not the asker's slot"
        with self._lock:
            if self._running >= self.most:
                return f"{msg.transfer_id!r}: {self.most} loans already running"
            self._running += 1
        loan = f"loan:{msg.sender}:{msg.transfer_id}"
        try:
            got = self.lender.lend(msg.key, msg.ref, loan)
        except BaseException:
            self._done()
            raise
        if isinstance(got, str):
            self._done()
            return got
        threading.Thread(target=self._send, args=(msg.ref, got, loan), name=f"lend-{loan}", daemon=True).start()
        return None

    def _send(self, ref: TensorRef, tensor: torch.Tensor, loan: str) -> None:
        pushed = False
        try:
            self.push(ref, tensor)
            pushed = True
        except (TransferError, ValueError) as e:
            logger.warning("%s: push to %s failed: %s", loan, ref.owner, e)
        finally:
            self.lender.give_back(loan, pushed)
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._running -= 1
