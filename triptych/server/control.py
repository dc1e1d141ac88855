"""The head's control socket: one ZMQ ROUTER that every worker's DEALER connects to.

``ControlPlane`` owns the socket and the map from instance id to ZMQ identity; it decodes each frame
into a typed worker message (a malformed one is counted and dropped) and hands it to ``on_message``.
It knows nothing of instances or requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

import zmq
import zmq.asyncio

from triptych.server import protocol as P

logger = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, host: str, port: int, stats: Counter, on_message: Callable[[bytes, P.WorkerMessage], None]):
        self.host = host
        self.port = port
        self.stats = stats
        self.on_message = on_message
        self.address = ""
        self._identity: dict[str, bytes] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    @property
    def open(self) -> bool:
        return self._sock is not None

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{self.host}:{self.port or '*'}")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.create_task(self._recv_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=1000)  # lets queued Shutdown/Cancel messages go out
            self._ctx.term()
            self._sock = None

    def bind(self, instance_id: str, identity: bytes) -> None:
        self._identity[instance_id] = identity

    def forget(self, instance_id: str) -> None:
        self._identity.pop(instance_id, None)

    def send(self, instance_id: str, msg: P.Message) -> None:
        """To a registered instance; nothing happens for one that left."""
        identity = self._identity.get(instance_id)
        if identity is not None:
            self.send_to(identity, msg)

    def send_to(self, identity: bytes, msg: P.Message) -> None:
        """To whoever holds ``identity`` (registration answers, rejoin requests)."""
        if self._sock is not None:
            self._sock.send_multipart([identity, P.encode(msg)])

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                self.stats["malformed"] += 1
                continue
            try:
                msg = P.decode_from_worker(frames[1])
            except P.ProtocolError as e:
                self.stats["malformed"] += 1
                logger.warning("dropped a control frame from %r: %s", frames[0][:64], e)
                continue
            self.on_message(frames[0], msg)
