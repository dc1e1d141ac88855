"""The head against scripted fake workers (raw ZMQ sockets): registration, stale and malformed input."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
from orchestrator_support import job

from triptych.pipelines.registry import load_family, make_tiny
from triptych.server import protocol as P
from triptych.server.auth import ControlKey
from triptych.server.backend import Cancelled
from triptych.server.orchestrator import Orchestrator, OrchestratorConfig

SPEC = {"cond.prompt_embeds": P.TensorSpec("float32", (1, 4, 8))}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny("flux", tmp_path_factory.mktemp("orch-proto") / "flux")
    return path, load_family(path, roles=())


@pytest.fixture
def head(model):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    orch = Orchestrator(model[0], OrchestratorConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=60.0))
    asyncio.run_coroutine_threadsafe(orch.start(), loop).result(30)
    yield orch, loop
    asyncio.run_coroutine_threadsafe(orch.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class FakeWorker:
    def __init__(self, ctx, head: Orchestrator, instance_id: str, role: str, revision: str | None = None):
        self.id = instance_id
        self.key = ControlKey(head.token)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, instance_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(head.control_address)
        self.send(
            P.Register(instance_id, role, 2, instance_id, "tcp://127.0.0.1:1", "zmq", revision or head.revision, 1)
        )
        self.ack = self.recv()

    def send(self, msg) -> None:
        self.sock.send_multipart(self.key.seal(P.encode(msg)))

    def recv(self, timeout_s: float = 30.0):
        assert self.sock.poll(timeout_s * 1000), f"{self.id}: no message from the head"
        return P.decode_from_head(self.key.open(self.sock.recv_multipart()))


def on_loop(loop, fn):
    async def run():
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), loop).result(30)


def test_revision_mismatch_is_refused(head):
    orch, loop = head
    ctx = zmq.Context()
    worker = FakeWorker(ctx, orch, "den-bad", "denoiser", revision="0" * 16)
    assert worker.ack.accepted is False and "revision" in worker.ack.reason
    assert on_loop(loop, orch.describe)["instances"] == []
    ctx.destroy(linger=0)


def test_stale_and_malformed_messages_are_dropped_and_cancel_reaches_every_holder(head, model):
    orch, loop = head
    ctx = zmq.Context()
    enc, den, dec = (FakeWorker(ctx, orch, f"{r}-0", r) for r in ("encoder", "denoiser", "decoder"))
    assert enc.ack.accepted and den.ack.accepted and dec.ack.accepted
    pending = asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "p-1")), loop)
    task = enc.recv()
    assert isinstance(task, P.EncodeTask) and task.denoiser == "denoiser-0" and task.generation == 1

    enc.sock.send_multipart(enc.key.seal(b"\xc1 not msgpack"))
    enc.send(P.EncodeDone("p-1", 7, "encoder-0", SPEC))  # a generation that does not exist
    den.send(P.EncodeDone("p-1", 1, "denoiser-0", SPEC))  # right generation, wrong sender
    enc.send(P.EncodeDone("p-1", 1, "encoder-0", SPEC))
    denoise = den.recv()
    assert isinstance(denoise, P.DenoiseTask) and denoise.source == "encoder-0" and denoise.decoder == "decoder-0"
    stats = on_loop(loop, orch.describe)["stats"]
    assert stats["malformed"] == 1 and stats["dropped_stale"] == 1 and stats["dropped_misrouted"] == 1

    assert asyncio.run_coroutine_threadsafe(orch.cancel("p-1"), loop).result(30)
    for worker in (enc, den, dec):
        msg = worker.recv()
        assert isinstance(msg, P.Cancel) and (msg.request_id, msg.generation) == ("p-1", 1)
    with pytest.raises(Cancelled, match="p-1"):
        pending.result(30)
    desc = on_loop(loop, orch.describe)
    assert desc["requests"] == {} and all(i["free"] == i["capacity"] for i in desc["instances"])
    ctx.destroy(linger=0)


def _next(worker, kind):
    """The next message of type ``kind`` (skipping others, e.g. the Cancels a retry sends)."""
    while True:
        msg = worker.recv()
        if isinstance(msg, kind):
            return msg


def test_a_retry_avoids_the_instance_that_failed_the_request(head, model):
    """A retryable stage failure (a denoiser evicted the request, e.g. out of memory) retries it on
    another instance of that role, even where the dispatch policy's turn would pick the same one."""
    orch, loop = head
    ctx = zmq.Context()
    enc = FakeWorker(ctx, orch, "encoder-0", "encoder")
    dens = {i: FakeWorker(ctx, orch, i, "denoiser") for i in ("denoiser-0", "denoiser-1")}
    dec = FakeWorker(ctx, orch, "decoder-0", "decoder")
    assert all(w.ack.accepted for w in (enc, dec, *dens.values()))
    first = asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "r-1")), loop)
    a = _next(enc, P.EncodeTask)
    asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "r-2")), loop)
    b = _next(enc, P.EncodeTask)
    assert {a.denoiser, b.denoiser} == set(dens)  # round robin: r-2 went to the other one
    enc.send(P.EncodeDone("r-1", 1, "encoder-0", SPEC))
    _next(dens[a.denoiser], P.DenoiseTask)
    dens[a.denoiser].send(P.StageError("r-1", 1, a.denoiser, "denoise", "OutOfMemoryError", "out of memory", True))
    retry = _next(enc, P.EncodeTask)
    assert (retry.request_id, retry.generation) == ("r-1", 2)
    assert retry.denoiser == b.denoiser != a.denoiser  # round robin's turn was a.denoiser again
    assert on_loop(loop, orch.describe)["stats"]["retries"] == 1
    asyncio.run_coroutine_threadsafe(orch.cancel("r-1"), loop).result(30)
    with pytest.raises(Cancelled):
        first.result(30)
    ctx.destroy(linger=0)


def test_a_worker_without_the_token_cannot_register_or_speak(head):
    """Registration and every later frame need the deployment's token: an unsigned ``Register`` and
    one signed with another token are answered with a refusal naming the token (the worker stops at
    once instead of waiting), any other badly signed frame is dropped unanswered; all are counted
    and none registers an instance."""
    orch, loop = head
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(orch.control_address)
    register = P.Register("den-rogue", "denoiser", 2, "den-rogue", "tcp://127.0.0.1:1", "zmq", orch.revision, 1)
    rogue.send(P.encode(register))
    assert rogue.poll(30_000)
    ack = P.decode_from_head(rogue.recv_multipart()[0])
    assert ack.accepted is False and "token" in ack.reason
    rogue.send_multipart(ControlKey("another-deployment-token").seal(P.encode(register)))
    assert rogue.poll(30_000) and P.decode_from_head(rogue.recv_multipart()[0]).accepted is False
    beat = P.Heartbeat("den-rogue", 0, 4, 4, 0)
    rogue.send_multipart(ControlKey("another-deployment-token").seal(P.encode(beat)))
    assert not rogue.poll(500)  # not a registration: nothing comes back
    desc = on_loop(loop, orch.describe)
    assert desc["instances"] == [] and desc["stats"]["unauthenticated"] == 3
    ctx.destroy(linger=0)


def test_a_second_worker_reusing_an_instance_id_is_refused_at_once(head):
    """Two processes claiming one instance id: the second gets a refusal on its own socket (a worker
    identity is unique per process), instead of waiting out its registration timeout."""
    orch, loop = head
    ctx = zmq.Context()
    first = FakeWorker(ctx, orch, "denoiser-7", "denoiser")
    assert first.ack.accepted

    class Second(FakeWorker):
        def __init__(self):
            self.id = "denoiser-7"
            self.key = ControlKey(orch.token)
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, b"denoiser-7#another-process")
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(orch.control_address)

    second = Second()
    second.send(P.Register("denoiser-7", "denoiser", 2, "denoiser-7", "tcp://127.0.0.1:2", "zmq", orch.revision, 2))
    ack = second.recv(timeout_s=10)
    assert ack.accepted is False and "already registered" in ack.reason
    assert [i["pid"] for i in on_loop(loop, orch.describe)["instances"]] == [1]
    ctx.destroy(linger=0)


@pytest.mark.parametrize("follow", [False, True])
def test_a_denoiser_is_asked_for_step_progress_only_when_someone_follows_it(head, model, follow):
    """Per-step ``Progress`` is asked for (``DenoiseTask.progress``) only when the caller passed
    ``on_progress`` (a video job, the CLI's bar); when asked, each step reaches the caller."""
    orch, loop = head
    ctx = zmq.Context()
    enc, den, dec = (FakeWorker(ctx, orch, f"{r}-0", r) for r in ("encoder", "denoiser", "decoder"))
    seen = []
    on_progress = (lambda step, total: seen.append((step, total))) if follow else None
    pending = asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "p-2"), on_progress), loop)
    assert isinstance(enc.recv(), P.EncodeTask)
    enc.send(P.EncodeDone("p-2", 1, "encoder-0", SPEC))
    denoise = _next(den, P.DenoiseTask)
    assert denoise.progress is follow
    den.send(P.Progress("p-2", 1, "denoiser-0", 1, 2))
    den.send(P.Progress("p-2", 1, "denoiser-0", 2, 2))
    den.send(P.EncodeDone("p-2", 1, "denoiser-0", SPEC))  # wrong sender: dropped and counted, and sent last,
    deadline = time.monotonic() + 30  # once it is counted, both Progress messages were handled
    while on_loop(loop, orch.describe)["stats"].get("dropped_misrouted", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    asyncio.run_coroutine_threadsafe(orch.cancel("p-2"), loop).result(30)
    with pytest.raises(Cancelled):
        pending.result(30)
    assert seen == ([(1, 2), (2, 2)] if follow else [])
    ctx.destroy(linger=0)
