"""Sender half of a transfer endpoint: one channel per receiver, and the two ways a push moves bytes.

Frames (always): a `DataPush` header frame plus the raw tensor bytes, zero-copy. Carrier writes
(when this endpoint has a carrier and the receiver's ref names a range of one): `WriteClaim` (ack)
-> the carrier's one-sided write -> `WriteDone` (ack -> READY), done reported even when the write
failed, so the receiver can release or reuse the range.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

import torch
import zmq

from triptych.transfer.capability import TransferKey
from triptych.transfer.carrier import Carrier
from triptych.transfer.channel import PeerChannel
from triptych.transfer.errors import TransferRejected
from triptych.transfer.messages import Ack, DataPush, FetchRequest, Request, WriteClaim, WriteDone
from triptych.transfer.refs import TensorRef, check_tensor
from triptych.transfer.stats import TransferStats


class PushSender:
    """Pushes tensors into receivers' reserved slots; owned by one endpoint.

    Ownership contract: it owns one `PeerChannel` per receiver address (created on first use,
    closed by `close`, before the endpoint terminates the shared ZMQ context); it borrows the
    endpoint's carrier, context and stats. A push holds no receiver memory: a slot freed meanwhile
    makes the receiver reject it (`TransferRejected`). Every request it sends is sealed with the
    capability of the slot it names (``key``; ``capability``). Thread-safe: channels serialize
    themselves.
    """

    def __init__(
        self,
        instance_id: str,
        ctx: zmq.Context,
        carrier: Carrier | None,
        stats: TransferStats,
        timeout_s: float,
        key: TransferKey,
    ) -> None:
        self.instance_id = instance_id
        self.key = key
        self.carrier = carrier
        self.stats = stats
        self.timeout_s = timeout_s  # default ack timeout of a push
        self._ctx = ctx
        self._seq = itertools.count(1)
        self._channels: dict[str, PeerChannel] = {}
        self._lock = threading.Lock()

    def push(self, ref: TensorRef, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        check_tensor(ref, tensor)
        data = tensor.detach().to("cpu").contiguous()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        if ref.mooncake is not None and self.carrier is not None:
            self._write(ref, data, timeout)
        else:
            msg = DataPush(
                next(self._seq),
                ref.transfer_id,
                self.instance_id,
                ref.dtype,
                ref.shape,
                ref.nbytes,
                ref.request,
                ref.slot,
            )
            self.request(ref, msg, [_raw_bytes(data)], timeout)
        self.stats.count_push(ref.nbytes, time.perf_counter() - start)

    def _write(self, ref: TensorRef, data: torch.Tensor, timeout_s: float) -> None:
        assert ref.mooncake is not None and self.carrier is not None
        claim = WriteClaim(next(self._seq), ref.transfer_id, self.instance_id, ref.nbytes, ref.request, ref.slot)
        self.request(ref, claim, [], timeout_s)
        failed = True
        try:
            self.carrier.write(ref.mooncake, data)
            failed = False
        finally:
            done = WriteDone(
                next(self._seq), ref.transfer_id, self.instance_id, ref.nbytes, failed, ref.request, ref.slot
            )
            self.request(ref, done, [], timeout_s)

    def request(self, ref: TensorRef, msg: Request, payload: Sequence[object], timeout_s: float) -> None:
        """Send one request to `ref`'s receiver; raises TransferRejected on a refusal."""
        ack = self._channel(ref.endpoint).request(msg, self._sealer(ref), payload, timeout_s)
        if not ack.ok:
            raise TransferRejected(f"{ref.owner} rejected {type(msg).__name__}: {ack.reason}")

    def ask(self, address: str, msg: FetchRequest, timeout_s: float) -> Ack:
        """Send a ``FetchRequest`` to the endpoint at ``address``, sealed with the capability of the
        asker's slot ``msg.ref``; its Ack, or TransferTimeout."""
        return self._channel(address).request(msg, self._sealer(msg.ref), [], timeout_s)

    def _sealer(self, ref: TensorRef):
        capability = self.key.capability(ref.transfer_id, ref.request, ref.owner, ref.slot)
        return lambda header: self.key.seal(capability, header)

    def next_seq(self) -> int:
        return next(self._seq)

    def _channel(self, address: str) -> PeerChannel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = PeerChannel(self._ctx, address)
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


def _raw_bytes(data: torch.Tensor) -> memoryview:
    if data.numel() == 0:
        return memoryview(b"")
    return memoryview(data.reshape(-1).view(torch.uint8).numpy())
