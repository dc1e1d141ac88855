"""ZMQ data path: the sender pushes a typed header frame plus the raw tensor bytes, zero-copy.

The receiver's tensor is a view over the received ZMQ frame (`torch.frombuffer`), so the bytes are
copied only by the kernel's socket buffers. Works anywhere pyzmq does; it is the fallback when
Mooncake is not installed.
"""

from __future__ import annotations

from triptych.server.transfer.base import TransferConfig
from triptych.server.transfer.peer import PeerEndpoint


class ZmqEndpoint(PeerEndpoint):
    """Transfer endpoint moving bytes over ZMQ.

    Ownership contract: a slot holds no buffer until its push arrives; the received frame becomes
    the slot's buffer and is handed to the caller of `wait_ready` (the returned tensor keeps the
    frame alive and nothing else references it). Pushes are accepted only for live reservations of
    the right sender, dtype, shape and size; anything else is rejected, counted and dropped.
    """

    kind = "zmq"

    def __init__(self, instance_id: str, config: TransferConfig | None = None) -> None:
        super().__init__(instance_id, config)
        self._start()
