"""Shared machinery of both backends: slot bookkeeping, the receiver thread and sender channels.

Every backend receives control messages (and, on the ZMQ data path, the tensor bytes) on one
ROUTER socket served by a background thread, and answers each with an `Ack`. Backends differ only
in where a slot's bytes live and how a sender moves them (the hooks at the bottom).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
import zmq

from triptych.server.transfer.base import TransferConfig, TransferEndpoint
from triptych.server.transfer.channel import PeerChannel
from triptych.server.transfer.errors import (
    PeerLost,
    TransferCancelled,
    TransferError,
    TransferRejected,
    TransferTimeout,
    UnknownTransfer,
)
from triptych.server.transfer.messages import (
    ENCODER,
    REQUEST_DECODER,
    Ack,
    DataPush,
    Request,
    WriteClaim,
    WriteDone,
)
from triptych.server.transfer.refs import (
    MooncakeLocation,
    TensorRef,
    check_tensor,
    dtype_name,
    tensor_nbytes,
)
from triptych.server.transfer.slots import SlotPool, SlotState
from triptych.server.transfer.stats import TransferStats

logger = logging.getLogger(__name__)

_REMEMBER_OUTCOMES = 1024


@dataclass
class Entry:
    """Receiver-side state of one live reservation (the pool holds its slot)."""

    ref: TensorRef
    peer: str  # the only sender allowed to fill the slot
    tensor: torch.Tensor | None = None  # set when the bytes arrived as a ZMQ frame
    error: TransferError | None = None  # set when freed before being taken
    offset: int | None = None  # backend buffer handle (Mooncake arena offset)
    claimed: bool = False  # a remote write into the buffer may be in flight


class PeerEndpoint(TransferEndpoint):
    """Common receiver/sender implementation; see `TransferEndpoint` for the contract.

    Threading: `_cond` guards the pool, the entries and the backend buffers. The serving thread
    owns the ROUTER socket; sender channels are shared by callers under their own lock.
    """

    kind = "base"

    def __init__(self, instance_id: str, config: TransferConfig | None = None) -> None:
        self.instance_id = instance_id
        self.config = config or TransferConfig()
        self.pool = SlotPool(self.config.max_slots, self.config.max_bytes)
        self.stats = TransferStats(backend=self.kind)
        self._cond = threading.Condition()
        self._entries: dict[str, Entry] = {}
        self._outcomes: OrderedDict[str, TransferError] = OrderedDict()
        self._seq = itertools.count(1)
        self._ctx = zmq.Context()
        self._channels: dict[str, PeerChannel] = {}
        self._channels_lock = threading.Lock()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://{self.config.host}:*")
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"transfer-{instance_id}", daemon=True)

    def _start(self) -> None:
        self._thread.start()
        logger.info("transfer endpoint %s (%s) serving at %s", self.instance_id, self.kind, self.address)

    # -- receiver ------------------------------------------------------------------------------
    def reserve(
        self, transfer_id: str, dtype: torch.dtype, shape: Sequence[int], peer: str, timeout_s: float
    ) -> TensorRef:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        shape = tuple(int(d) for d in shape)
        nbytes = tensor_nbytes(dtype, shape)
        with self._cond:
            slot = self.pool.reserve(transfer_id, nbytes, peer, time.monotonic() + timeout_s)
            try:
                offset, location = self._allocate(transfer_id, nbytes)
            except TransferError:
                self.pool.release(transfer_id)
                raise
            ref = TensorRef(
                transfer_id, dtype_name(dtype), shape, nbytes, self.instance_id, slot, self.address, location
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
        """True when no slot is reserved and every backend buffer is free (full capacity)."""
        with self._cond:
            return self.pool.is_full_capacity() and not self._entries and self._buffers_idle()

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
            while len(self._outcomes) > _REMEMBER_OUTCOMES:
                self._outcomes.popitem(last=False)
        self._free(entry)
        self._cond.notify_all()

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
        try:
            msg = REQUEST_DECODER.decode(frames[0].buffer) if frames else None
        except msgspec.DecodeError as exc:
            msg, reason = None, f"bad header: {exc}"
        else:
            reason = "empty message" if msg is None else None
        if msg is not None:
            with self._cond:
                reason = self._admit(msg, frames[1:])
        if reason is not None:
            self.stats.add(rejected_pushes=1)
            logger.warning("rejected %s: %s", type(msg).__name__, reason)
        seq, tid = (msg.seq, msg.transfer_id) if msg is not None else (-1, "")
        return Ack(seq, tid, reason is None, reason or "")

    def _admit(self, msg: Request, payload: list[zmq.Frame]) -> str | None:
        """Validate and apply one request; returns the rejection reason or None. Holds `_cond`."""
        entry = self._entries.get(msg.transfer_id)
        slot = self.pool.get(msg.transfer_id)
        if entry is None or slot is None:
            return self._on_unreserved(msg)
        if msg.sender != slot.peer:
            return f"{msg.transfer_id!r}: sender {msg.sender!r} is not the reserved peer {slot.peer!r}"
        if msg.nbytes != entry.ref.nbytes:
            return f"{msg.transfer_id!r}: {msg.nbytes} bytes != reserved {entry.ref.nbytes}"
        if isinstance(msg, WriteDone):
            return self._on_write_done(entry, msg)
        if slot.state is not SlotState.RESERVED or entry.claimed:
            return f"{msg.transfer_id!r}: duplicate push (slot is {slot.state.value})"
        if isinstance(msg, WriteClaim):
            return self._on_claim(entry)
        ref = entry.ref
        if (msg.dtype, tuple(msg.shape)) != (ref.dtype, ref.shape):
            return f"{msg.transfer_id!r}: {msg.dtype}{list(msg.shape)} != reserved {ref.dtype}{list(ref.shape)}"
        if len(payload) != 1 or len(payload[0].buffer) != entry.ref.nbytes:
            return f"{msg.transfer_id!r}: payload is not one frame of {entry.ref.nbytes} bytes"
        entry.tensor = _frame_tensor(payload[0], entry.ref)
        self._mark_ready(entry)
        return None

    def _mark_ready(self, entry: Entry) -> None:
        self.pool.mark_ready(entry.ref.transfer_id)
        self.stats.add(pushes_received=1, bytes_received=entry.ref.nbytes)
        self._cond.notify_all()

    # -- sender ----------------------------------------------------------------------------------
    def push(self, ref: TensorRef, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        check_tensor(ref, tensor)
        data = tensor.detach().to("cpu").contiguous()
        timeout = self.config.push_timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        self._push(ref, data, timeout)
        self.stats.add(pushes_sent=1, bytes_sent=ref.nbytes, push_seconds=time.perf_counter() - start)

    def _push_data(self, ref: TensorRef, data: torch.Tensor, timeout_s: float) -> None:
        """ZMQ data path: header frame + the raw bytes frame, zero-copy."""
        msg = DataPush(next(self._seq), ref.transfer_id, self.instance_id, ref.dtype, ref.shape, ref.nbytes)
        self._request(ref, msg, [_raw_bytes(data)], timeout_s)

    def _request(self, ref: TensorRef, msg: Request, payload: Sequence[object], timeout_s: float) -> None:
        ack = self._channel(ref.endpoint).request(msg, payload, timeout_s)
        if not ack.ok:
            raise TransferRejected(f"{ref.owner} rejected {type(msg).__name__}: {ack.reason}")

    def _channel(self, address: str) -> PeerChannel:
        with self._channels_lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = PeerChannel(self._ctx, address)
            return channel

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._cond:
            for transfer_id in list(self._entries):
                self._finish(transfer_id, TransferCancelled(f"{transfer_id!r}: endpoint closed"))
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        self._router.close(linger=0)
        self._ctx.term()
        self._close_backend()
        logger.info("transfer endpoint %s closed", self.instance_id)

    def __enter__(self) -> PeerEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- backend hooks (caller holds `_cond` except for `_push`) ---------------------------------
    def _allocate(self, transfer_id: str, nbytes: int) -> tuple[int | None, MooncakeLocation | None]:
        """Buffer for a new reservation: (handle kept in the entry, location put in the ref)."""
        return None, None

    def _take(self, entry: Entry) -> torch.Tensor:
        """The READY tensor, owning its storage."""
        assert entry.tensor is not None
        return entry.tensor

    def _free(self, entry: Entry) -> None:
        """Free the entry's backend buffer (the slot is already released)."""

    def _on_unreserved(self, msg: Request) -> str:
        return f"{msg.transfer_id!r}: no live reservation"

    def _on_claim(self, entry: Entry) -> str | None:
        return f"{entry.ref.transfer_id!r}: {self.kind} receiver does not accept remote writes"

    def _on_write_done(self, entry: Entry, msg: WriteDone) -> str | None:
        return f"{entry.ref.transfer_id!r}: {self.kind} receiver does not accept remote writes"

    def _buffers_idle(self) -> bool:
        return True

    def _reclaim_parked(self, peer: str) -> None:
        """Free buffers held back for `peer`'s in-flight remote writes."""

    def _push(self, ref: TensorRef, data: torch.Tensor, timeout_s: float) -> None:
        self._push_data(ref, data, timeout_s)

    def _close_backend(self) -> None:
        """Release backend resources after the serving thread stopped."""


def _raw_bytes(data: torch.Tensor) -> memoryview:
    if data.numel() == 0:
        return memoryview(b"")
    return memoryview(data.reshape(-1).view(torch.uint8).numpy())


def _frame_tensor(frame: zmq.Frame, ref: TensorRef) -> torch.Tensor:
    """A tensor over the frame's memory (no copy); it keeps the frame alive and owns it alone."""
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=ref.torch_dtype)
    raw = torch.frombuffer(frame.buffer, dtype=torch.uint8)
    return raw.view(ref.torch_dtype).reshape(ref.shape)
