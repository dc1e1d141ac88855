"""Scripted fake workers for tests of the head: raw ZMQ DEALER sockets speaking the control protocol
(signed with the head's token), and the head's orchestrator on an event loop thread of its own."""

from __future__ import annotations

import asyncio
import threading

import zmq

from triptych.control import protocol as P
from triptych.control.auth import ControlKey
from triptych.control.orchestrator import Orchestrator, OrchestratorConfig
from triptych.worker.control_client import ControlClient


class FakeWorker:
    def __init__(
        self, ctx, head: Orchestrator, instance_id: str, role: str, revision: str | None = None, identity: bytes = b""
    ):
        self.id = instance_id
        self.key = ControlKey(head.token)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity or instance_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(head.control_address)
        self.client = ControlClient(self.sock, self.key)
        register = P.Register(
            instance_id=instance_id,
            role=role,
            capacity=2,
            control=instance_id,
            data="tcp://127.0.0.1:1",
            transfer="zmq",
            revision=revision or head.revision,
            pid=1,
        )
        self.ack = self.client.register(register, 30.0, on_skipped=print)

    def send(self, msg) -> None:
        self.client.send(msg)

    def recv(self, timeout_s: float = 30.0):
        assert self.sock.poll(timeout_s * 1000), f"{self.id}: no message from the head"
        return self.client.recv()


def on_loop(loop, fn):
    async def run():
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), loop).result(30)


def next_of(worker, kind):
    """The next message of type ``kind`` (skipping others, e.g. the Cancels a retry sends)."""
    while True:
        msg = worker.recv()
        if isinstance(msg, kind):
            return msg


class HeadThread:
    """An ``Orchestrator`` of ``model_dir`` started on an event loop running in its own thread."""

    def __init__(self, model_dir, config: OrchestratorConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.orch = Orchestrator(model_dir, config)
        self.call(self.orch.start())

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def on_loop(self, fn, *args):
        return on_loop(self.loop, lambda: fn(*args))

    def close(self) -> None:
        self.call(self.orch.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
