"""The head against scripted fake workers (raw ZMQ sockets): registration, stale and malformed input."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq
from fake_workers import FakeWorker, next_of, on_loop
from orchestrator_support import job

from tests.e2e.http_support import wait_for
from triptych.control import protocol as P
from triptych.control.auth import ControlKey, SequencedSender
from triptych.control.backend import Cancelled
from triptych.control.orchestrator import Orchestrator, OrchestratorConfig
from triptych.families.registry import load_family, make_tiny
from triptych.worker.control_client import ControlClient

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

    enc.client.sender.send(b"\xc1 not msgpack")
    enc.send(
        P.EncodeDone(request_id="p-1", generation=7, instance_id="encoder-0", specs=SPEC)
    )  # a generation that does not exist
    den.send(
        P.EncodeDone(request_id="p-1", generation=1, instance_id="denoiser-0", specs=SPEC)
    )  # right generation, wrong sender
    enc.send(P.EncodeDone(request_id="p-1", generation=1, instance_id="encoder-0", specs=SPEC))
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
    a = next_of(enc, P.EncodeTask)
    asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "r-2")), loop)
    b = next_of(enc, P.EncodeTask)
    assert {a.denoiser, b.denoiser} == set(dens)  # round robin: r-2 went to the other one
    enc.send(P.EncodeDone(request_id="r-1", generation=1, instance_id="encoder-0", specs=SPEC))
    next_of(dens[a.denoiser], P.DenoiseTask)
    dens[a.denoiser].send(
        P.StageError(
            request_id="r-1",
            generation=1,
            instance_id=a.denoiser,
            stage="denoise",
            kind="OutOfMemoryError",
            message="out of memory",
            retryable=True,
        )
    )
    retry = next_of(enc, P.EncodeTask)
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
    register = P.Register(
        instance_id="den-rogue",
        role="denoiser",
        capacity=2,
        control="den-rogue",
        data="tcp://127.0.0.1:1",
        transfer="zmq",
        revision=orch.revision,
        pid=1,
    )
    rogue.send(P.encode(register))
    assert rogue.poll(30_000)
    ack = P.decode_from_head(rogue.recv_multipart()[0])
    assert ack.accepted is False and "token" in ack.reason
    rogue.send_multipart(ControlKey("another-deployment-token").seal(P.encode(register)))
    assert rogue.poll(30_000) and P.decode_from_head(rogue.recv_multipart()[0]).accepted is False
    beat = P.Heartbeat(instance_id="den-rogue", active=0, free_slots=4, max_slots=4, engine_running=0)
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
            self.client = ControlClient(self.sock, self.key)

    second = Second()
    register = P.Register(
        instance_id="denoiser-7",
        role="denoiser",
        capacity=2,
        control="denoiser-7",
        data="tcp://127.0.0.1:2",
        transfer="zmq",
        revision=orch.revision,
        pid=2,
    )
    ack = second.client.register(register, 10.0, on_skipped=print)
    assert ack.accepted is False and "already registered" in ack.reason
    assert [i["pid"] for i in on_loop(loop, orch.describe)["instances"]] == [1]
    ctx.destroy(linger=0)


@pytest.mark.parametrize("follow", [False, True])
def test_a_denoiser_is_asked_for_step_progress_only_when_someone_follows_it(head, model, follow):
    """Per-step progress is asked for (``DenoiseTask.progress``) only when the caller passed
    ``on_progress`` (a video job, the CLI's bar); when asked, each step in a ``TickReport`` reaches
    the caller, and entries of another generation or an ended request are counted and dropped."""
    orch, loop = head
    ctx = zmq.Context()
    enc, den, dec = (FakeWorker(ctx, orch, f"{r}-0", r) for r in ("encoder", "denoiser", "decoder"))
    seen = []
    on_progress = (lambda step, total: seen.append((step, total))) if follow else None
    pending = asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "p-2"), on_progress), loop)
    assert isinstance(enc.recv(), P.EncodeTask)
    enc.send(P.EncodeDone(request_id="p-2", generation=1, instance_id="encoder-0", specs=SPEC))
    denoise = next_of(den, P.DenoiseTask)
    assert denoise.progress is follow
    for step in (1, 2):  # one report per engine tick; the stale and the ended entries are dropped
        progress = (
            P.StepProgress(request_id="p-2", generation=1, step=step, total=2),
            P.StepProgress(request_id="p-2", generation=0, step=step, total=2),
            P.StepProgress(request_id="gone", generation=1, step=step, total=2),
        )
        den.send(P.TickReport(instance_id="denoiser-0", progress=progress))
    den.send(
        P.EncodeDone(request_id="p-2", generation=1, instance_id="denoiser-0", specs=SPEC)
    )  # wrong sender: dropped and counted, and sent last,
    # once it is counted, both Progress messages were handled
    wait_for(lambda: on_loop(loop, orch.describe)["stats"].get("dropped_misrouted", 0) >= 1, "dropped_misrouted")
    asyncio.run_coroutine_threadsafe(orch.cancel("p-2"), loop).result(30)
    with pytest.raises(Cancelled):
        pending.result(30)
    assert seen == ([(1, 2), (2, 2)] if follow else [])
    stats = on_loop(loop, orch.describe)["stats"]
    assert stats["dropped_stale"] == 2 and stats["dropped_after_end"] == 2
    ctx.destroy(linger=0)


class Recorder:
    """Keeps a copy of every frame a socket sends (what an eavesdropper on loopback captures)."""

    def __init__(self, worker: FakeWorker):
        self.frames: list[list[bytes]] = []
        send = worker.client.sender._send

        def record(frames):
            self.frames.append([bytes(f) for f in frames])
            send(frames)

        worker.client.sender._send = record


def _replayer(ctx, orch, identity: bytes | None = None):
    sock = ctx.socket(zmq.DEALER)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(orch.control_address)
    return sock


def _stat(loop, orch, name):
    return on_loop(loop, orch.describe)["stats"].get(name, 0)


def _wait_stat(loop, orch, name, at_least, deadline_s=30.0):
    wait_for(lambda: _stat(loop, orch, name) >= at_least, f"{name} >= {at_least}", deadline_s)


def test_replayed_register_and_heartbeats_register_nothing_and_are_counted(head, model):
    """Issue 24 item 2: a worker's signed Hello/Register/Heartbeat frames, captured and replayed from
    a second socket (while it lives, and under its own identity after it died), register no ghost,
    keep nothing alive and are counted (``replays_refused``, a Prometheus head event); the real worker
    keeps working, and a replacement under the same instance id registers after it died."""
    orch, loop = head
    ctx = zmq.Context()

    class Captured(FakeWorker):  # the same handshake, recording every frame the socket sends
        def __init__(self, instance_id, role):
            self.id = instance_id
            self.key = ControlKey(orch.token)
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, instance_id.encode())
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(orch.control_address)
            self.client = ControlClient(self.sock, self.key)
            self.tap = Recorder(self)
            register = P.Register(
                instance_id=instance_id,
                role=role,
                capacity=2,
                control=instance_id,
                data="tcp://127.0.0.1:1",
                transfer="zmq",
                revision=orch.revision,
                pid=1,
            )
            self.ack = self.client.register(register, 30.0, on_skipped=print)

    den = Captured("denoiser-0", "denoiser")
    enc, dec = FakeWorker(ctx, orch, "encoder-0", "encoder"), FakeWorker(ctx, orch, "decoder-0", "decoder")
    assert den.ack.accepted and enc.ack.accepted and dec.ack.accepted
    for _ in range(3):
        den.send(P.Heartbeat(instance_id="denoiser-0", active=0, free_slots=4, max_slots=4, engine_running=0))
    hello, register, *beats = den.tap.frames
    assert P.decode_any(register[1]) == P.Register(
        instance_id="denoiser-0",
        role="denoiser",
        capacity=2,
        control="denoiser-0",
        data="tcp://127.0.0.1:1",
        transfer="zmq",
        revision=orch.revision,
        pid=1,
    )

    # while the worker lives: another socket replays its frames
    rogue = _replayer(ctx, orch)
    for frames in (register, *beats):
        rogue.send_multipart(frames)
    assert rogue.poll(30_000)
    refusal = P.decode_from_head(den.key.open(rogue.recv_multipart()))
    assert isinstance(refusal, P.RegisterAck) and not refusal.accepted and "replayed" in refusal.reason
    _wait_stat(loop, orch, "replays_refused", 1 + len(beats))
    # ... and the real worker keeps working: a request reaches it, its heartbeats count
    pending = asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "r-1")), loop)
    assert isinstance(next_of(enc, P.EncodeTask), P.EncodeTask)
    enc.send(P.EncodeDone(request_id="r-1", generation=1, instance_id="encoder-0", specs=SPEC))
    assert next_of(den, P.DenoiseTask).request_id == "r-1"
    refused = _stat(loop, orch, "replays_refused")
    den.send(P.Heartbeat(instance_id="denoiser-0", active=1, free_slots=3, max_slots=4, engine_running=1))

    def reported_active():
        reports = {i["id"]: i["report"] for i in on_loop(loop, orch.describe)["instances"]}
        return reports["denoiser-0"].get("active") == 1

    wait_for(reported_active, "the real worker's heartbeat counted")
    assert _stat(loop, orch, "replays_refused") == refused
    asyncio.run_coroutine_threadsafe(orch.cancel("r-1"), loop).result(30)
    with pytest.raises(Cancelled):
        pending.result(30)

    # the worker dies; a socket taking over its very identity replays its whole conversation
    den.sock.close(0)
    on_loop(loop, lambda: orch.instance_dead("denoiser-0", "killed by the test"))
    ghost = _replayer(ctx, orch, identity=b"denoiser-0")

    def knock():  # the ROUTER lets the identity be reused once it saw the old socket go
        if ghost.poll(200):
            return True
        ghost.send_multipart(hello)
        return False

    wait_for(knock, "the dead worker's identity to become free")
    assert isinstance(P.decode_from_head(den.key.open(ghost.recv_multipart())), P.Challenge)
    for frames in (register, *beats):
        ghost.send_multipart(frames)

    def answer_from_head():
        assert ghost.poll(30_000), "the head did not answer the replayed frames"
        return P.decode_from_head(den.key.open(ghost.recv_multipart()))

    while not isinstance(answer := answer_from_head(), P.RegisterAck):
        assert isinstance(answer, P.Challenge)  # one per Hello sent while the identity was taken
    assert not answer.accepted and "refused" in answer.reason  # sealed under a spent challenge
    _wait_stat(loop, orch, "replays_refused", refused + 1 + len(beats))
    assert "denoiser-0" not in {i["id"] for i in on_loop(loop, orch.describe)["instances"]}

    # a replacement under the same id registers, and the count is a Prometheus series
    ghost.close(0)
    replacement = FakeWorker(ctx, orch, "denoiser-0", "denoiser", identity=b"denoiser-0#replacement")
    assert replacement.ack.accepted
    orch.metrics.update_from_describe(on_loop(loop, orch.describe))
    text = orch.metrics.render().decode()
    line = next(x for x in text.splitlines() if x.startswith('triptych_head_events_total{event="replays_refused"}'))
    assert float(line.split()[-1]) >= refused + 1 + len(beats)
    ctx.destroy(linger=0)


def test_a_job_a_worker_reports_that_the_head_does_not_hold_is_cancelled(head, model):
    """Issue 24 item 4: a worker's stats report lists the jobs it holds; each whose request (at that
    generation) the head does not hold on it is answered with a ``Cancel`` and counted
    (``orphans_cancelled``), while the job the head did route to it is left running."""
    orch, loop = head
    ctx = zmq.Context()
    enc, den, dec = (FakeWorker(ctx, orch, f"{r}-0", r) for r in ("encoder", "denoiser", "decoder"))
    pending = asyncio.run_coroutine_threadsafe(orch.run(job(model[1], "live-1")), loop)
    next_of(enc, P.EncodeTask)
    enc.send(P.EncodeDone(request_id="live-1", generation=1, instance_id="encoder-0", specs=SPEC))
    next_of(den, P.DenoiseTask)
    transfer = P.TransferStats(backend="zmq")
    held = (("live-1", 1), ("live-1", 0), ("gone-7", 3))  # the routed job, an older attempt, an unknown one
    den.send(P.StatsReport(instance_id="denoiser-0", uptime_s=1.0, engine=None, transfer=transfer, jobs=held))
    cancels = {(m.request_id, m.generation) for m in (next_of(den, P.Cancel), next_of(den, P.Cancel))}
    assert cancels == {("live-1", 0), ("gone-7", 3)}
    assert _stat(loop, orch, "orphans_cancelled") == 2
    den.send(
        P.StatsReport(instance_id="denoiser-0", uptime_s=2.0, engine=None, transfer=transfer, jobs=(("live-1", 1),))
    )
    den.send(
        P.Heartbeat(instance_id="denoiser-0", active=1, free_slots=3, max_slots=4, engine_running=1)
    )  # its answer, if any, would come before this one's none
    assert not den.sock.poll(500) and _stat(loop, orch, "orphans_cancelled") == 2
    assert on_loop(loop, orch.describe)["requests"] == {"denoising": 1}
    asyncio.run_coroutine_threadsafe(orch.cancel("live-1"), loop).result(30)
    with pytest.raises(Cancelled):
        pending.result(30)
    ctx.destroy(linger=0)


def test_a_worker_declared_dead_is_asked_to_rejoin_on_its_control_socket(head):
    """The heartbeat socket never reads: a ``Rejoin`` sent in answer to a heartbeat would be lost and,
    once per interval, keep the one in answer to the worker's next control frame from being sent (a
    stalled worker kept stepping a batch nobody waited for). A heartbeat is not answered; the control
    socket's next frame is."""
    orch, loop = head
    ctx = zmq.Context()
    beat_sock = ctx.socket(zmq.DEALER)
    beat_sock.setsockopt(zmq.IDENTITY, b"denoiser-3#heartbeat")
    beat_sock.setsockopt(zmq.LINGER, 0)
    beat_sock.connect(orch.control_address)
    beats = SequencedSender(ControlKey(orch.token), beat_sock.send_multipart)

    class WithHeartbeats(FakeWorker):
        def __init__(self):
            self.id, self.key = "denoiser-3", ControlKey(orch.token)
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, b"denoiser-3#control")
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(orch.control_address)
            self.client = ControlClient(self.sock, self.key)
            reg = P.Register(
                instance_id="denoiser-3", role="denoiser", capacity=2, control="denoiser-3", data="tcp://127.0.0.1:1", transfer="zmq", revision=orch.revision, pid=3,
                channels=(b"denoiser-3#heartbeat",),
            )  # fmt: skip
            self.ack = self.client.register(reg, 30.0, on_skipped=print)

    den = WithHeartbeats()
    assert den.ack.accepted
    beats.session = den.client.session
    on_loop(loop, lambda: orch.instance_dead("denoiser-3", "declared dead by the test"))
    beats.send(P.encode(P.Heartbeat(instance_id="denoiser-3", active=0, free_slots=4, max_slots=4, engine_running=0)))
    _wait_stat(loop, orch, "from_unknown_instance", 1)
    den.send(
        P.StatsReport(
            instance_id="denoiser-3", uptime_s=1.0, engine=None, transfer=P.TransferStats(backend="zmq"), mm_cache=None
        )
    )
    assert isinstance(next_of(den, P.Rejoin), P.Rejoin)
    assert not beat_sock.poll(200)  # nothing was sent where nobody reads
    ctx.destroy(linger=0)


def test_a_worker_of_a_previous_head_is_asked_to_rejoin(head):
    """A remote worker outliving its head keeps its session; a head started at the same address never
    issued it, and answers the worker's first control frame with ``Rejoin`` (it registers anew)."""
    orch, loop = head
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(orch.control_address)
    client = ControlClient(sock, ControlKey(orch.token))
    client.sender.session = bytes(range(16))  # issued by the head that died
    client.send(
        P.StatsReport(
            instance_id="encoder-9", uptime_s=1.0, engine=None, transfer=P.TransferStats(backend="zmq"), mm_cache=None
        )
    )
    assert sock.poll(30_000) and isinstance(client.recv(), P.Rejoin)
    assert _stat(loop, orch, "replays_refused") == 0
    ctx.destroy(linger=0)
