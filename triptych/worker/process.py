"""The role worker process: registers with the head, then serves one role's stage.

One loop, three verbs: ``receive()`` control messages → ``execute()`` one unit of stage work (an
encode, a chat token, one engine step, a decode) → ``collect()`` finished transfers. The stage work
is the role's runner (``worker/runners/``), which reaches this process only through its port
(``worker.port.JobPort``, which builds it: the job table, transfers off the loop, failures); heartbeats go out from
their own thread and socket.

Rank 0 is the instance's only control and data endpoint; the other ranks of a multi-rank denoiser
receive their work from rank 0's runner, never from the head.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import torch
import zmq

from triptych.control import protocol as P
from triptych.control.auth import ControlKey, SequencedSender
from triptych.control.worker_config import WorkerConfig
from triptych.core.errors import TriptychError
from triptych.core.identity import model_revision
from triptych.core.kinds import Role
from triptych.transfer import TransferConfig, make_endpoint
from triptych.worker import mm_remote
from triptych.worker.control_client import ControlClient
from triptych.worker.parent_death import die_with_parent
from triptych.worker.port import JobPort
from triptych.worker.runners import RunnerBroken, StageRunner, make_runner

logger = logging.getLogger(__name__)


class RegistrationRefused(TriptychError):
    """The head refused this worker (e.g. its model revision differs) or never answered."""


class Worker:
    """A role process (rank 0). ``run()`` blocks until ``Shutdown`` or ``stop()``."""

    def __init__(self, config: WorkerConfig):
        from triptych.families.registry import family_class

        self.config = config
        self.role = Role(config.role)
        self.instance_id = config.instance_id or f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.family = family_class(config.model_dir)(
            config.model_dir,
            roles={self.role},
            device=config.device,
            mm_cache_config=config.mm_cache,
            speed=config.speed,
        )
        if self.role == Role.DENOISER and (config.lora.lora or config.lora.lora_root):
            self.family.enable_lora(config.lora)  # a multi-rank instance's followers get it in RankSetup
        if config.speed.compile and self.role is Role.DENOISER and config.parallel.world_size == 1:
            from triptych.engine.warmup import warm_up

            warm_up(self.family)  # before registering: the head routes only to a warm instance
        # A multi-rank instance warms every rank up once its parallelism is attached (the runner, below).
        if config.speed.compile and self.role is Role.DECODER and self.family.compile_vae_decoder:
            from triptych.engine.warmup import warm_up_decoder

            warm_up_decoder(self.family)
        if self.role == Role.ENCODER and (config.lora.lora or config.lora.lora_root):
            self.family.enable_lora(config.lora)  # text-encoder parts, where the family's format has them
        self.endpoint = make_endpoint(
            config.transfer,
            self.instance_id,
            TransferConfig(
                host=config.host,
                max_slots=max(4, 8 * config.capacity),
                max_bytes=config.transfer_max_bytes,
                token=config.token,  # the slots' capabilities derive from the deployment token
            ),
        )
        self._stop = threading.Event()
        self._key = ControlKey(config.token)
        self._ctx = zmq.Context()
        self._sock = self._dealer("control")
        self._control = ControlClient(self._sock, self._key)
        # The heartbeat thread's own socket, made here so its identity goes into ``Register.channels``.
        self._hb_sock = self._dealer("heartbeat")
        self._hb = SequencedSender(self._key, self._hb_sock.send_multipart)
        # A transfer that ends on the port's threads wakes the loop's poll at once (an idle loop would
        # otherwise see it only at its next poll timeout, once per stage hop).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

        def runner(port: JobPort) -> StageRunner:  # the port builds its runner, so each is whole once built
            return make_runner(self.role, self.family, port, config)

        self.port = JobPort(self.instance_id, self.send, self.endpoint, self._stop, runner, wake=self._wake)
        self.runner: StageRunner = self.port.runner
        cache = getattr(self.family, "mm_cache", None)
        if cache is not None and config.mm_cache.remote:  # cross-encoder embedding hits (``mm_remote``)
            mm_remote.attach(cache, self.endpoint, config.mm_cache.remote_timeout_s)
        self._hb_interval = 1.0
        self._hb_thread: threading.Thread | None = None
        self._started = time.monotonic()
        self._next_report = 0.0

    # ---- control socket -----------------------------------------------------------------------
    def _dealer(self, purpose: str) -> zmq.Socket:
        """A socket to the head. Its ZMQ identity is unique to this process (the head learns it from
        ``Register``), so a second process reusing an instance id gets its refusal, not silence."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.instance_id}#{purpose}#{uuid.uuid4().hex[:8]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.head)
        return sock

    def send(self, msg: P.Message) -> None:
        self._control.send(msg)

    def _recv(self) -> P.HeadMessage:
        return self._control.recv()

    def register(self) -> None:
        chat = self.role is Role.ENCODER and self.family.chat_model() is not None
        register = P.Register(
            instance_id=self.instance_id,
            role=self.role.value,
            capacity=self.config.capacity,
            control=self.instance_id,
            data=self.endpoint.address,
            transfer=self.endpoint.kind,
            revision=model_revision(self.config.model_dir),
            pid=os.getpid(),
            chat=chat,
            channels=(self._hb_sock.getsockopt(zmq.IDENTITY),),
            chat_slots=self.config.chat.chat_slots if chat else 0,
        )

        def skipped(what) -> None:  # a stale Rejoin, a malformed frame
            logger.warning("%s skipped %s while registering", self.instance_id, what)

        try:
            ack = self._control.register(register, self.config.register_timeout_s, skipped)
        except TimeoutError as e:
            raise RegistrationRefused(f"{e} ({self.config.head}) in {self.config.register_timeout_s}s") from None
        if not ack.accepted:
            raise RegistrationRefused(f"head refused {self.instance_id}: {ack.reason}")
        self._hb.session = self._control.session  # heartbeats speak for the new session from now on
        self._hb_interval = ack.heartbeat_interval_s
        logger.info(
            "%s registered with %s (transfer %s at %s)",
            self.instance_id,
            self.config.head,
            self.endpoint.kind,
            self.endpoint.address,
        )

    def _parent_gone(self) -> bool:
        return self.config.parent_pid > 0 and os.getppid() != self.config.parent_pid

    def _orphaned(self) -> None:
        """The spawning head is gone: stop the loop, and exit hard if it does not stop in time."""
        logger.error("%s: parent process %d is gone; exiting", self.instance_id, self.config.parent_pid)
        self._stop.set()
        timer = threading.Timer(self.config.parent_grace_s, os._exit, (4,))
        timer.daemon = True
        timer.start()

    def _heartbeats(self) -> None:
        """The heartbeat thread: it alone uses ``_hb_sock`` while it runs."""
        while not self._stop.wait(self._hb_interval):
            if self._parent_gone():
                return self._orphaned()
            pool = self.endpoint.pool
            beat = P.Heartbeat(
                instance_id=self.instance_id,
                active=len(self.port.jobs),
                free_slots=pool.free_slots,
                max_slots=pool.max_slots,
                engine_running=self.runner.engine_running(),
            )
            self._hb.send(P.encode(beat))

    # ---- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self._parent_gone():
                raise RegistrationRefused(f"parent process {self.config.parent_pid} is gone before registration")
            self.register()
        except BaseException:
            self.close()
            raise
        self._hb_thread = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self._hb_thread.start()
        try:
            while not self._stop.is_set():
                busy = self.runner.has_work()
                self.receive(timeout_ms=0 if busy else 20)
                if self.runner.has_work():
                    self.runner.execute()
                self.port.collect()
                self.report_stats()
        finally:
            self.close()

    def report_stats(self) -> None:
        """Send cumulative ``StatsReport`` counters, at most once per heartbeat interval.

        Sent from the loop thread (which owns the engine's stats and the job table), not the heartbeat
        thread: stats may lag during a long forward; liveness never does. It lists the jobs held, so
        the head cancels any whose request it no longer holds (an orphan) within one report.
        """
        now = time.monotonic()
        if now < self._next_report:
            return
        self._next_report = now + self._hb_interval
        runner = self.runner
        report = P.StatsReport(
            instance_id=self.instance_id,
            uptime_s=now - self._started,
            engine=runner.engine_stats(),
            transfer=self.endpoint.stats.snapshot(),
            mm_cache=runner.cache_stats(),
            chat=runner.chat_stats(),
            compute=runner.compute_stats(),
            jobs=tuple((rid, job.generation) for rid, job in self.port.jobs.items()),
        )
        self.send(report)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (a wake is pending anyway) or closed
            pass

    def receive(self, timeout_ms: int) -> None:
        """Handle every control message that is there, waiting up to ``timeout_ms`` for the first one
        or for a transfer to end (the port's wake pipe)."""
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while self._sock.poll(0):
            try:
                msg = self._recv()
            except P.ProtocolError as e:
                logger.warning("%s dropped a malformed control frame: %s", self.instance_id, e)
                continue
            self.handle(msg)

    def handle(self, msg: P.HeadMessage) -> None:
        if isinstance(msg, P.Shutdown):
            logger.info("%s shutting down: %s", self.instance_id, msg.reason)
            self._stop.set()
        elif isinstance(msg, P.Rejoin):
            self.rejoin(msg.reason)
        elif isinstance(msg, P.Cancel):
            self.port.drop(msg.request_id, msg.generation, msg.reason)
        elif isinstance(msg, P.PeerDown):
            self.endpoint.reclaim_peer(msg.instance_id)
        elif isinstance(msg, P.PushTask):
            self.port.push(msg)
        elif isinstance(msg, P.RegisterAck):
            logger.warning("%s got an unexpected RegisterAck: %s", self.instance_id, msg.reason)
        else:
            try:
                self.runner.accept(msg)
            except P.ProtocolError as e:
                logger.warning("%s: %s", self.instance_id, e)

    def rejoin(self, reason: str) -> None:
        """The head no longer counts us (it declared us dead and retried our requests elsewhere):
        drop every job, let transfers already running end, and register again under the same id."""
        logger.warning(
            "%s: the head asks us to rejoin (%s); dropping %d job(s)", self.instance_id, reason, len(self.port.jobs)
        )
        self.port.drop_all("rejoining the head")
        self.port.settle(self.config.register_timeout_s)
        try:
            self.register()
        except RegistrationRefused as e:
            logger.error("%s: could not rejoin: %s", self.instance_id, e)
            self._stop.set()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        self.runner.close()
        self.port.drop_all("worker closing")
        self.port.close()
        self.endpoint.close()
        self._sock.close(linger=0)
        self._hb_sock.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)


def run_worker(config: WorkerConfig) -> int:
    """Process entry: build, register, serve until shutdown. Returns the exit code. A worker spawned
    by a head (``parent_pid``) first asks the kernel to end it when the head exits
    (``parent_death.die_with_parent``), before it spends time loading its model."""
    if config.parent_pid > 0:
        die_with_parent(config.parent_pid)
    worker = Worker(config)
    try:
        worker.run()
    except RegistrationRefused as e:
        logger.error("%s", e)
        return 3
    except RunnerBroken as e:
        logger.error("%s", e)
        return 5
    return 0
