"""A worker's end of the control plane: its signed, sequenced sends and the registration handshake.

``ControlClient`` wraps the worker's DEALER to the head (one thread uses it): ``send`` seals each
message under the worker's session with the socket's next sequence number (``auth``), ``recv``
opens the head's frames, and ``register`` runs ``Hello`` → ``Challenge`` → ``Register`` →
``RegisterAck`` (``sessions`` says why). The worker process and the scripted workers of the tests
share it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from triptych.control import protocol as P
from triptych.control.auth import ControlKey, SequencedSender


class ControlClient:
    def __init__(self, sock: zmq.Socket, key: ControlKey):
        self.sock = sock
        self.key = key
        self.sender = SequencedSender(key, sock.send_multipart)

    @property
    def identity(self) -> bytes:
        return self.sock.getsockopt(zmq.IDENTITY)

    @property
    def session(self) -> bytes:
        return self.sender.session

    def send(self, msg: P.Message) -> None:
        self.sender.send(P.encode(msg))

    def recv(self) -> P.HeadMessage:
        """The next control message; raises ``ProtocolError`` for an unsigned or malformed frame,
        except the head's unsigned refusal of a worker that does not hold the token."""
        frames = self.sock.recv_multipart()
        payload = self.key.open(frames)
        if payload is None:
            msg = P.decode_from_head(frames[0])
            if isinstance(msg, P.RegisterAck) and not msg.accepted:
                return msg
            raise P.ProtocolError("a control frame with a bad signature")
        return P.decode_from_head(payload)

    def register(
        self, register: P.Register, timeout_s: float, on_skipped: Callable[[Exception | P.HeadMessage], None]
    ) -> P.RegisterAck:
        """Ask for a challenge, register under it; the head's ``RegisterAck`` (a refusal included).
        Raises ``TimeoutError`` when the head does not answer in ``timeout_s``. What arrives before
        each answer (a stale ``Rejoin``, a malformed frame) goes to ``on_skipped``."""
        deadline = time.monotonic() + timeout_s
        self.send(P.Hello(instance_id=register.instance_id))
        answer = self._await((P.Challenge, P.RegisterAck), deadline, on_skipped)
        if isinstance(answer, P.RegisterAck):  # refused before a challenge: no token
            return answer
        self.sender.session = answer.nonce
        self.send(register)
        return self._await((P.RegisterAck,), deadline, on_skipped)

    def _await(self, kinds: tuple[type, ...], deadline: float, on_skipped) -> P.HeadMessage:
        while True:
            if not self.sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TimeoutError(f"no {kinds[0].__name__} from the head")
            try:
                msg = self.recv()
            except P.ProtocolError as e:
                on_skipped(e)
                continue
            if isinstance(msg, kinds):
                return msg
            on_skipped(msg)
