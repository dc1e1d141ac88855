"""The head's control socket: one ZMQ ROUTER that every worker's DEALER connects to.

``ControlPlane`` owns the socket and the map from instance id to ZMQ identity; it checks each frame's
MAC (``auth.ControlKey``: an unauthenticated frame is counted and dropped, except a ``Register``,
which is answered with a refusal so a worker with a wrong token stops at once), decodes it into a
typed worker message (a malformed one is counted and dropped) and hands it to ``on_message``. It
knows nothing of instances or requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

import zmq
import zmq.asyncio

from triptych.server import protocol as P
from triptych.server.auth import ControlKey

logger = logging.getLogger(__name__)


class ControlPlane:
    def __init__(
        self,
        host: str,
        port: int,
        key: ControlKey,
        stats: Counter,
        on_message: Callable[[bytes, P.WorkerMessage], None],
    ):
        self.host = host
        self.key = key
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
            self._sock.send_multipart([identity, *self.key.seal(P.encode(msg))])

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) not in (2, 3):
                self.stats["malformed"] += 1
                continue
            payload = self.key.open(frames[1:])
            if payload is None:
                self._unauthenticated(frames[0], frames[1])
                continue
            try:
                msg = P.decode_from_worker(payload)
            except P.ProtocolError as e:
                self.stats["malformed"] += 1
                logger.warning("dropped a control frame from %r: %s", frames[0][:64], e)
                continue
            self.on_message(frames[0], msg)

    def _unauthenticated(self, identity: bytes, payload: bytes) -> None:
        self.stats["unauthenticated"] += 1
        try:
            msg = P.decode_from_worker(payload)
        except P.ProtocolError:
            return
        if isinstance(msg, P.Register):  # tell it why, unsigned: a refusal grants nothing
            logger.warning(
                "refused %s: its control frames are not signed with this deployment's token", msg.instance_id
            )
            refusal = P.RegisterAck(msg.instance_id, False, "wrong or missing control-plane token (--token)", 0.0)
            if self._sock is not None:
                self._sock.send_multipart([identity, P.encode(refusal), b""])
