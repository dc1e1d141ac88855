"""The transfer endpoint: slot bookkeeping, the receiver thread and the receiving end of the protocol.

Every endpoint receives control messages and tensor bytes on one ROUTER socket served by a
background thread, and answers each with an `Ack`. The ZMQ data path is built in: the sender
pushes a typed header frame plus the raw tensor bytes, zero-copy, and the receiver's tensor is a
view over the received frame (`torch.frombuffer`), so the bytes are copied only by the kernel's
socket buffers. It works anywhere pyzmq does and is what `make_endpoint("zmq")` builds.

An endpoint may also hold a `Carrier` (Mooncake, `mooncake_backend.py`): then each reservation gets
a range of the carrier's registered memory, named in the `TensorRef`, and a sender whose carrier
can reach it writes there one-sidedly: WriteClaim (ack) -> carrier write -> WriteDone (ack ->
READY). Either side without a carrier falls back to frames, so the two kinds interoperate. The
sending half (channels, both push paths) is `sender.PushSender`, one per endpoint.

Every request is sealed with the capability of the slot it names (``capability``): ``gate.Gate``
refuses one without a valid capability before it is read, and the socket drops any frame larger
than the pool could ever hold (``zmq.MAXMSGSIZE``) before it is read whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zmq
from cachetools import FIFOCache

from triptych.core.errors import shown
from triptych.core.kinds import TransferKind
from triptych.transfer.base import TransferConfig, TransferEndpoint
from triptych.transfer.capability import TransferKey
from triptych.transfer.carrier import Carrier
from triptych.transfer.errors import (
    PeerLost,
    SlotUnavailable,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    UnknownTransfer,
)
from triptych.transfer.gate import REFUSED, Gate
from triptych.transfer.lending import Lending
from triptych.transfer.messages import ENCODER, MAX_HEADER_BYTES, Ack, FetchRequest, Request, WriteClaim, WriteDone
from triptych.transfer.refs import TensorRef, dtype_name, tensor_nbytes
from triptych.transfer.sender import PushSender
from triptych.transfer.slots import SlotPool, SlotState
from triptych.transfer.stats import TransferStats

logger = logging.getLogger(__name__)

_REMEMBER_OUTCOMES = 1024


@dataclass
class Entry:
    """Receiver-side state of one live reservation (the pool holds its slot)."""

    ref: TensorRef
    peer: str  # the only sender allowed to fill the slot
    tensor: torch.Tensor | None = None  # set when the bytes arrived as a ZMQ frame
    error: TransferError | None = None  # set when freed before being taken
    offset: int | None = None  # the carrier range the slot's bytes may be written into
    claimed: bool = False  # a remote write into the range may be in flight


class PeerEndpoint(TransferEndpoint):
    """One instance's transfer endpoint; see `TransferEndpoint` for the contract.

    Ownership contract: a slot holds a carrier range from `reserve` until it is freed (none without
    a carrier; a frame that arrives becomes the slot's buffer and is handed to the caller of
    `wait_ready`, which alone references it). A range whose sender already claimed it is *parked*
    when its slot is freed (timeout, cancel) and returned to the carrier only when that sender's
    WriteDone arrives or the sender is reclaimed as dead, so a late write never lands in another
    transfer's tensor. The carrier (if any) is closed with the endpoint. Pushes are accepted only
    for live reservations of the right sender, dtype, shape and size; anything else is rejected,
    counted and dropped.

    Threading: `_cond` guards the pool, the entries, the parked ranges and the carrier's ranges.
    The serving thread owns the ROUTER socket; sender channels are shared by callers under their
    own lock.
    """

    def __init__(self, instance_id: str, config: TransferConfig | None = None, carrier: Carrier | None = None) -> None:
        self.instance_id = instance_id
        self.config = config or TransferConfig()
        self.carrier = carrier
        self.kind = carrier.kind if carrier is not None else TransferKind.ZMQ
        self.pool = SlotPool(self.config.max_slots, self.config.max_bytes)
        self.stats = TransferStats(backend=self.kind)
        self._cond = threading.Condition()
        self._entries: dict[str, Entry] = {}
        self._parked: dict[str, tuple[int, str]] = {}  # transfer id -> (carrier offset, peer)
        self._outcomes: FIFOCache[str, TransferError] = FIFOCache(_REMEMBER_OUTCOMES)  # the oldest forgotten
        self._ctx = zmq.Context()
        key = TransferKey(self.config.token)
        self.gate = Gate(key, instance_id, self.stats)
        self.sender = PushSender(instance_id, self._ctx, carrier, self.stats, self.config.push_timeout_s, key)
        self.lending: Lending | None = None  # what it lends to peers' FetchRequests (``lend_from``); None: nothing
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # No slot is larger than the pool: a bigger frame is dropped (its peer disconnected) unread.
        self._router.setsockopt(zmq.MAXMSGSIZE, max(self.config.max_bytes, MAX_HEADER_BYTES))
        self._router.bind(f"tcp://{self.config.host}:*")
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"transfer-{instance_id}", daemon=True)
        self._thread.start()
        logger.info("transfer endpoint %s (%s) serving at %s", self.instance_id, self.kind, self.address)

    # -- receiver ------------------------------------------------------------------------------
    def reserve(
        self,
        transfer_id: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        peer: str,
        timeout_s: float,
        request: str = "",
    ) -> TensorRef:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        shape = tuple(int(d) for d in shape)
        nbytes = tensor_nbytes(dtype, shape)
        with self._cond:
            slot = self.pool.reserve(transfer_id, nbytes, peer, time.monotonic() + timeout_s)
            offset = location = None
            if self.carrier is not None:
                landing = self.carrier.allocate(nbytes)
                if landing is None:
                    self.pool.release(transfer_id)
                    raise SlotUnavailable(
                        f"{transfer_id!r}: no contiguous {nbytes} bytes in the arena "
                        f"({self.carrier.free_bytes} free, {len(self._parked)} ranges parked)"
                    )
                offset, location = landing
            ref = TensorRef(
                transfer_id, dtype_name(dtype), shape, nbytes, self.instance_id, slot, self.address, location, request
            )
            self._entries[transfer_id] = Entry(ref, peer, offset=offset)
        self.stats.add(reservations=1)
        return ref

    def wait_ready(self, transfer_id: str, timeout_s: float | None = None) -> torch.Tensor:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            entry = self._entries.get(transfer_id)
            if entry is None:
                raise self._outcome(transfer_id)
            while entry.error is None:
                slot = self.pool.get(transfer_id)
                if slot is None:  # taken by a concurrent waiter
                    raise UnknownTransfer(f"transfer id {transfer_id!r} was already taken")
                if slot.state is SlotState.READY:
                    tensor = self._take(entry)
                    self._finish(transfer_id, None)
                    return tensor
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self.stats.add(timeouts=1)
                    self._finish(transfer_id, TransferTimeout(f"{transfer_id!r}: no push in {timeout_s}s"))
                    break
                self._cond.wait(remaining)
            raise type(entry.error)(*entry.error.args)

    def release(self, transfer_id: str) -> bool:
        with self._cond:
            return self._finish(transfer_id, TransferCancelled(f"{transfer_id!r} released by receiver"))

    def cancel(self, transfer_id: str) -> bool:
        with self._cond:
            done = self._finish(transfer_id, TransferCancelled(f"{transfer_id!r} cancelled"))
        if done:
            self.stats.add(cancels=1)
        return done

    def reclaim_peer(self, peer: str) -> list[str]:
        with self._cond:
            slots = self.pool.reclaim_peer(peer)
            for slot in slots:
                self._forget(slot.transfer_id, PeerLost(f"{slot.transfer_id!r}: peer {peer!r} lost"))
            self._reclaim_parked(peer)
        self.stats.add(reclaimed=len(slots))
        if slots:
            logger.warning("reclaimed %d slots of dead peer %s", len(slots), peer)
        return [s.transfer_id for s in slots]

    def idle(self) -> bool:
        """True when no slot is reserved and every carrier range is free (full capacity)."""
        with self._cond:
            carrier_idle = self.carrier is None or self.carrier.allocated == 0
            return self.pool.is_full_capacity() and not self._entries and not self._parked and carrier_idle

    def _finish(self, transfer_id: str, error: TransferError | None) -> bool:
        """Release the slot and free its buffer; caller holds `_cond`."""
        if self.pool.release(transfer_id) is None:
            return False
        self._forget(transfer_id, error)
        return True

    def _forget(self, transfer_id: str, error: TransferError | None) -> None:
        entry = self._entries.pop(transfer_id)
        if error is not None:
            entry.error, entry.tensor = error, None
            self._outcomes[transfer_id] = error
        self._free(entry)
        self._cond.notify_all()

    def _take(self, entry: Entry) -> torch.Tensor:
        """The READY tensor, owning its storage: the received frame, or a copy of the carrier range."""
        if entry.tensor is not None:
            return entry.tensor
        assert self.carrier is not None and entry.offset is not None
        return self.carrier.read(entry.offset, entry.ref)

    def _free(self, entry: Entry) -> None:
        """Return the entry's carrier range (the slot is already released), or park it."""
        if entry.offset is None:
            return
        assert self.carrier is not None
        if entry.claimed:
            # NOTE: the sender may still be writing into this range; reusing it now could let
            # the late write corrupt another transfer's tensor.
            self._parked[entry.ref.transfer_id] = (entry.offset, entry.peer)
            return
        self.carrier.free(entry.offset)

    def _reclaim_parked(self, peer: str) -> None:
        """Return the ranges held back for `peer`'s in-flight writes (it is dead)."""
        for transfer_id, (offset, owner) in list(self._parked.items()):
            if owner == peer:
                del self._parked[transfer_id]
                self.carrier.free(offset)

    def _outcome(self, transfer_id: str) -> TransferError:
        error = self._outcomes.get(transfer_id)
        if error is None:
            return UnknownTransfer(f"transfer id {transfer_id!r} holds no slot")
        return type(error)(*error.args)

    # -- serving thread --------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._serve_loop()
        except BaseException:
            logger.exception("transfer endpoint %s: serving thread crashed", self.instance_id)
            with self._cond:
                for transfer_id in list(self._entries):
                    self._finish(transfer_id, TransferError(f"{transfer_id!r}: receiver thread crashed"))
            raise

    def _serve_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        tick_ms = self.config.poll_interval_s * 1000
        while not self._stop.is_set():
            if poller.poll(tick_ms):
                frames = self._router.recv_multipart(copy=False)
                ack = self._handle(frames[1:])
                self._router.send_multipart([frames[0], ENCODER.encode(ack)])
            self._expire()

    def _expire(self) -> None:
        with self._cond:
            expired = self.pool.expire(time.monotonic())
            for slot in expired:
                self._forget(slot.transfer_id, TransferTimeout(f"{slot.transfer_id!r} reservation expired"))
        if expired:
            self.stats.add(timeouts=len(expired))
            logger.info("expired %d reservations: %s", len(expired), [s.transfer_id for s in expired])

    def _handle(self, frames: list[zmq.Frame]) -> Ack:
        msg = self.gate.open(frames)
        if isinstance(msg, Ack):  # no valid capability: refused unread, counted by the gate
            return msg
        if isinstance(msg, FetchRequest):
            reason = "this endpoint lends nothing" if self.lending is None else self.lending.lend(msg)
        else:
            with self._cond:
                reason = self._admit(msg, frames[2:])
        if reason == REFUSED:
            return self.gate.refuse(msg, "the capability of another slot or request")
        if reason is not None:
            self.stats.add(rejected_pushes=1)
            logger.warning("rejected %s: %s", type(msg).__name__, reason)
        return Ack(msg.seq, msg.transfer_id, reason is None, reason or "")

    def _admit(self, msg: Request, payload: list[zmq.Frame]) -> str | None:
        """Validate and apply one authentic request; returns the rejection reason or None. Holds `_cond`."""
        entry = self._entries.get(msg.transfer_id)
        slot = self.pool.get(msg.transfer_id)
        tid = shown(msg.transfer_id)
        if entry is None or slot is None:
            return self._unreserved(msg, tid)
        if (msg.request, msg.slot) != (entry.ref.request, entry.ref.slot):
            return REFUSED  # sealed for a slot of that id that is not this one
        if msg.sender != slot.peer:
            return f"{tid}: sender {shown(msg.sender)} is not the reserved peer {shown(slot.peer)}"
        if msg.nbytes != entry.ref.nbytes:
            return f"{tid}: {msg.nbytes} bytes != reserved {entry.ref.nbytes}"
        if isinstance(msg, WriteDone):
            return self._write_done(entry, msg, tid)
        if slot.state is not SlotState.RESERVED or entry.claimed:
            self.stats.add(replays_refused=1)
            return f"{tid}: duplicate push (slot is {slot.state.value})"
        if isinstance(msg, WriteClaim):
            if entry.offset is None:
                return f"{tid}: {self.kind} receiver does not accept remote writes"
            entry.claimed = True
            return None
        ref = entry.ref
        if (msg.dtype, tuple(msg.shape)) != (ref.dtype, ref.shape):
            return f"{tid}: {msg.dtype}{list(msg.shape)[:8]} != reserved {ref.dtype}{list(ref.shape)}"
        if len(payload) != 1 or len(payload[0].buffer) != entry.ref.nbytes:
            return f"{tid}: payload is not one frame of {entry.ref.nbytes} bytes"
        entry.tensor = _frame_tensor(payload[0], entry.ref)
        self._mark_ready(entry)
        return None

    def _write_done(self, entry: Entry, msg: WriteDone, tid: str) -> str | None:
        if entry.offset is None:
            return f"{tid}: {self.kind} receiver does not accept remote writes"
        if not entry.claimed:
            self.stats.add(replays_refused=1)
            return f"{tid}: write done without a claim"
        entry.claimed = False
        if msg.failed:
            self._finish(msg.transfer_id, TransferError(f"{tid}: sender's write failed"))
            return None
        self._mark_ready(entry)
        return None

    def _unreserved(self, msg: Request, tid: str) -> str:
        """An authentic request for no live slot: the WriteDone of a parked range returns the range;
        one for a slot released already is a replay (or a sender too late), counted as one."""
        parked = self._parked.get(msg.transfer_id)
        if isinstance(msg, WriteDone) and parked is not None and parked[1] == msg.sender:
            del self._parked[msg.transfer_id]
            self.carrier.free(parked[0])
            return f"{tid}: reservation was released before the write completed"
        if self.pool.finished(msg.transfer_id):
            self.stats.add(replays_refused=1)
            return f"{tid}: already filled or released"
        return f"{tid}: no live reservation"

    def _mark_ready(self, entry: Entry) -> None:
        self.pool.mark_ready(entry.ref.transfer_id)
        self.stats.add(pushes_received=1, bytes_received=entry.ref.nbytes)
        self._cond.notify_all()

    # -- sender ----------------------------------------------------------------------------------
    def lend_from(self, lending: Lending) -> None:
        """Answer peers' ``FetchRequest``s from ``lending`` (``worker.mm_remote.attach``; before it,
        this endpoint lends nothing). Made after construction: what it lends pushes through this
        endpoint."""
        self.lending = lending

    def push(self, ref: TensorRef, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        self.sender.push(ref, tensor, timeout_s)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._cond:
            for transfer_id in list(self._entries):
                self._finish(transfer_id, TransferCancelled(f"{transfer_id!r}: endpoint closed"))
        self.sender.close()
        self._router.close(linger=0)
        self._ctx.term()
        if self.carrier is not None:
            self.carrier.close()
        logger.info("transfer endpoint %s closed", self.instance_id)

    def __enter__(self) -> PeerEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _frame_tensor(frame: zmq.Frame, ref: TensorRef) -> torch.Tensor:
    """A tensor over the frame's memory (no copy); it keeps the frame alive and owns it alone."""
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=ref.torch_dtype)
    raw = torch.frombuffer(frame.buffer, dtype=torch.uint8)
    return raw.view(ref.torch_dtype).reshape(ref.shape)
