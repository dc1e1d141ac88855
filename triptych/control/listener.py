"""The head's control socket: one ZMQ ROUTER that every worker's DEALER connects to.

``ControlPlane`` owns the socket and the map from instance id to ZMQ identity; it checks each frame's
MAC (``auth.ControlKey``: an unauthenticated frame is counted and dropped, except a ``Hello`` or
``Register``, which is answered with a refusal so a worker with a wrong token stops at once), decodes
it into a typed worker message (a malformed one is counted and dropped), and checks its freshness
(``sessions.SessionTable``): it answers ``Hello`` with a ``Challenge`` itself, refuses a ``Register``
not sealed under a challenge it issued to that socket, and drops a replayed frame or one from a
socket its instance was not bound to (``replays_refused``) or from a session its instance replaced
(``stale_session``). The rest goes to ``on_message``. It knows nothing of instances or requests.

Bounded input: a frame larger than ``MAX_FRAME_BYTES`` (above the largest legitimate message, a
decoded video in a ``MediaResult``) makes ZMQ drop its peer before the frame is read whole
(``zmq.MAXMSGSIZE``); an id a peer sends is logged cut and escaped (``shown``), and a refusal
echoes it cut.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from triptych.control import protocol as P
from triptych.control.auth import ControlKey
from triptych.control.counters import ControlCounters
from triptych.control.sessions import SessionTable, Verdict
from triptych.core.errors import shown

logger = logging.getLogger(__name__)

#: Largest control frame the head reads (``zmq.MAXMSGSIZE``): above any worker's legitimate message
#: (a decoder fails a request whose media would not fit, ``protocol.MAX_MEDIA_BYTES``).
MAX_FRAME_BYTES = P.MAX_FRAME_BYTES
#: Longest instance id a refusal echoes back.
_ECHO_ID = 256


class ControlPlane:
    def __init__(
        self,
        host: str,
        port: int,
        key: ControlKey,
        counters: ControlCounters,
        on_message: Callable[[bytes, P.WorkerMessage], None],
    ):
        self.host = host
        self.key = key
        self.port = port
        self.counters = counters
        self.on_message = on_message
        self.address = ""
        self._identity: dict[str, bytes] = {}
        self.sessions = SessionTable()
        self._registering: tuple[bytes, bytes, int] | None = (
            None  # (identity, session, seq) of the Register being handled
        )
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
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
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

    def bind(self, instance_id: str, identity: bytes, channels: tuple[bytes, ...] = ()) -> None:
        """Admit the ``Register`` being handled (called from ``on_message``): only ``identity`` and the
        ``channels`` it named speak for ``instance_id``, under the session it was sealed under."""
        assert self._registering is not None and self._registering[0] == identity, "bind outside a Register"
        _, session, seq = self._registering
        self._identity[instance_id] = identity
        others = [c for c in channels if c != identity]
        self.sessions.bind(instance_id, session, [identity, *others], {identity: seq})

    def forget(self, instance_id: str) -> None:
        self._identity.pop(instance_id, None)
        self.sessions.retire(instance_id)

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
        """Each frame, then a turn for the rest of the loop: awaiting a receive that a queued frame
        answers at once never suspends, so a steady flow (a worker streaming a chat's pieces) held
        the loop until it stopped, and with it the HTTP side: a client that left was
        noticed, and its chat cancelled, only after the answer had ended."""
        while True:
            self.receive(await self._sock.recv_multipart())
            await asyncio.sleep(0)

    def receive(self, frames: list[bytes]) -> None:
        """One frame as the ROUTER delivered it: ``[identity, header, payload, mac]``."""
        if len(frames) not in (2, 3, 4):
            self.counters.malformed += 1
            return
        identity = bytes(frames[0])
        opened = self.key.open_sequenced(frames[1:])
        if opened is None:
            return self._unauthenticated(identity, frames[1:])
        session, seq, payload = opened
        try:
            msg = P.decode_from_worker(payload)
        except P.ProtocolError as e:
            self.counters.malformed += 1
            logger.warning("dropped a control frame from %s: %s", shown(identity), shown(str(e), 200))
            return
        if isinstance(msg, P.Hello):
            self.send_to(
                identity,
                P.Challenge(instance_id=msg.instance_id, nonce=self.sessions.challenge(identity, msg.instance_id)),
            )
        elif isinstance(msg, P.Register):
            reason = self.sessions.admit(identity, session, msg.instance_id)
            if reason is not None:
                self._replay(identity, msg, reason)
                self.send_to(
                    identity,
                    P.RegisterAck(
                        instance_id=msg.instance_id,
                        accepted=False,
                        reason=f"registration refused: {reason}",
                        heartbeat_interval_s=0.0,
                    ),
                )
                return
            self._registering = (identity, session, seq)
            try:
                self.on_message(identity, msg)
            finally:
                self._registering = None
        else:
            verdict = self.sessions.check(identity, session, seq, msg.instance_id)
            if verdict is Verdict.REPLAY:
                self._replay(identity, msg, "an old sequence number, or a socket its session is not bound to")
            elif verdict is Verdict.STALE:
                self.counters.stale_session += 1
            else:  # OK, or ORPHAN: the registry asks a live but unregistered instance to rejoin
                self.on_message(identity, msg)

    def _replay(self, identity: bytes, msg: P.WorkerMessage, why: str) -> None:
        self.counters.replays_refused += 1
        n = self.counters.replays_refused
        log = logger.warning if n == 1 or n % 1000 == 0 else logger.debug
        name, who = type(msg).__name__, shown(msg.instance_id)
        log("dropped %s for %s from %s: %s (%d so far)", name, who, shown(identity), why, n)

    def _unauthenticated(self, identity: bytes, frames: list[bytes]) -> None:
        self.counters.unauthenticated += 1
        try:
            msg = P.decode_from_worker(frames[1 if len(frames) == 3 else 0])
        except P.ProtocolError:
            return
        if isinstance(msg, P.Hello | P.Register):  # tell it why, unsigned: a refusal grants nothing
            n = self.counters.unauthenticated
            if n == 1 or n % 1000 == 0:
                logger.warning(
                    "refused %s: its control frames are not signed with this deployment's token (%d so far)",
                    shown(msg.instance_id),
                    n,
                )
            reason = "wrong or missing control-plane token (--token), or a worker older than this head"
            refusal = P.RegisterAck(
                instance_id=msg.instance_id[:_ECHO_ID], accepted=False, reason=reason, heartbeat_interval_s=0.0
            )
            if self._sock is not None:
                self._sock.send_multipart([identity, P.encode(refusal), b""])
