"""The role worker process: registers with the head, then serves one role's stage.

One loop, three verbs: ``receive()`` control messages → ``execute()`` one unit of stage work (an
encode, one engine step, a decode) → ``collect()`` finished transfers. Blocking transfer calls
(pushes to a peer, waits for a peer's push) run on a small thread pool so a slow or dead peer never
stalls the loop; heartbeats go out from their own thread and socket.

Ownership: a request's tensors belong to this worker from the moment they are produced (or their
slots are reserved) until they were pushed downstream (``PushDone``), decoded, or a ``Cancel`` /
``PeerDown`` freed them. Rank 0 is the instance's only control and data endpoint; other ranks of a
multi-rank denoiser would receive work from rank 0 (not implemented yet: one rank per instance).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from triptych.errors import InvalidParam, TriptychError
from triptych.pipelines.base import Role
from triptych.server import protocol as P
from triptych.server.engine import EngineConfig
from triptych.server.transfer import TransferConfig, TransferError, make_endpoint
from triptych.server.transfer.refs import dtype_from_name
from triptych.server.worker_stages import Job, StageRunner, make_runner

logger = logging.getLogger(__name__)


class RegistrationRefused(TriptychError):
    """The head refused this worker (e.g. its model revision differs) or never answered."""


def model_revision(model_dir: str | Path) -> str:
    """sha256 over the model directory's JSON/text configs (relative path + bytes), sorted."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".txt")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process."""

    role: Role
    """Which pool this instance serves; it loads only that role's components."""
    head: str
    """Head control address, ``tcp://HOST:PORT``."""
    model_dir: Path
    """Diffusers model directory (same configs as the head's, checked by revision)."""
    instance_id: str = ""
    """Unique id; empty = ``<role>-<random>``."""
    capacity: int = 4
    """Requests this instance may hold at once (the head never routes more)."""
    transfer: str = "auto"
    """Transfer backend: auto | mooncake | zmq."""
    host: str = "127.0.0.1"
    """Address the transfer endpoint binds and advertises."""
    transfer_max_bytes: int = 256 << 20
    """Receiver bytes of the transfer slot pool."""
    device: str = "cpu"
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Denoiser step batching (ignored by other roles)."""
    register_timeout_s: float = 120.0
    """How long to wait for the head's ``RegisterAck``."""
    torch_threads: int = 0
    """``torch.set_num_threads`` (0 = leave torch's default)."""
    parent_pid: int = 0
    """Exit when this process (the head that spawned us) is gone: a head killed with SIGKILL leaves no
    orphan workers holding memory and devices. 0 = independent (remote workers)."""
    parent_grace_s: float = 10.0
    """After the parent is gone, how long the loop may take to stop (a forward may be running)
    before the process exits hard."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity} must be >= 1")
        if not self.head.startswith("tcp://"):
            raise ValueError(f"head={self.head!r} must look like tcp://HOST:PORT")
        if self.register_timeout_s <= 0:
            raise ValueError(f"register_timeout_s={self.register_timeout_s} must be > 0")


class Worker:
    """A role process (rank 0). ``run()`` blocks until ``Shutdown`` or ``stop()``."""

    def __init__(self, config: WorkerConfig):
        from triptych.pipelines.registry import family_class

        self.config = config
        self.role = Role(config.role)
        self.instance_id = config.instance_id or f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.family = family_class(config.model_dir)(config.model_dir, roles={self.role}, device=config.device)
        self.endpoint = make_endpoint(
            config.transfer,
            self.instance_id,
            TransferConfig(
                host=config.host, max_slots=max(4, 8 * config.capacity), max_bytes=config.transfer_max_bytes
            ),
        )
        self.jobs: dict[str, Job] = {}
        self.runner: StageRunner = make_runner(self)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"xfer-{self.instance_id}")
        self._pending: list[tuple[Future, str, int, str]] = []  # (future, request id, generation, what)
        self._ctx = zmq.Context()
        self._sock = self._dealer(self.instance_id)
        self._stop = threading.Event()
        self._hb_interval = 1.0
        self._hb_thread: threading.Thread | None = None
        self._started = time.monotonic()
        self._next_report = 0.0

    # ---- control socket -----------------------------------------------------------------------
    def _dealer(self, identity: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.head)
        return sock

    def send(self, msg: P.Message) -> None:
        self._sock.send(P.encode(msg))

    def register(self) -> None:
        self.send(
            P.Register(
                self.instance_id,
                self.role.value,
                self.config.capacity,
                self.instance_id,
                self.endpoint.address,
                self.endpoint.kind,
                model_revision(self.config.model_dir),
                os.getpid(),
                self.role is Role.ENCODER and self.family.chat_model() is not None,
            )
        )
        deadline = time.monotonic() + self.config.register_timeout_s
        ack = None
        while not isinstance(ack, P.RegisterAck):  # skips what the head sent before it (a stale Rejoin)
            if not self._sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise RegistrationRefused(
                    f"no RegisterAck from {self.config.head} in {self.config.register_timeout_s}s"
                )
            try:
                ack = P.decode_from_head(self._sock.recv())
            except P.ProtocolError as e:
                logger.warning("%s dropped a malformed control frame: %s", self.instance_id, e)
        if not ack.accepted:
            raise RegistrationRefused(f"head refused {self.instance_id}: {getattr(ack, 'reason', ack)}")
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
        sock = self._dealer(f"{self.instance_id}#hb")
        try:
            while not self._stop.wait(self._hb_interval):
                if self._parent_gone():
                    return self._orphaned()
                pool = self.endpoint.pool
                sock.send(
                    P.encode(
                        P.Heartbeat(
                            self.instance_id,
                            len(self.jobs),
                            pool.free_slots,
                            pool.max_slots,
                            self.runner.engine_running(),
                        )
                    )
                )
        finally:
            sock.close(linger=0)

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
                self.collect()
                self.report_stats()
        finally:
            self.close()

    def report_stats(self) -> None:
        """Send cumulative ``StatsReport`` counters, at most once per heartbeat interval.

        Sent from the loop thread (which owns ``EngineStats``), not the heartbeat thread: stats may
        lag during a long forward; liveness never does.
        """
        now = time.monotonic()
        if now < self._next_report:
            return
        self._next_report = now + self._hb_interval
        snap = self.endpoint.stats.snapshot()
        transfer = P.TransferReport(**{f: snap[f] for f in P.TransferReport.__struct_fields__})
        cache = getattr(self.family, "mm_cache", None)
        mm = None
        if cache is not None:
            s = cache.stats
            mm = P.CacheReport(s.hits, s.misses, s.bypassed, s.evictions, len(cache), cache.nbytes)
        self.send(P.StatsReport(self.instance_id, now - self._started, self.runner.engine_report(), transfer, mm))

    def receive(self, timeout_ms: int) -> None:
        while self._sock.poll(timeout_ms):
            timeout_ms = 0
            raw = self._sock.recv()
            try:
                msg = P.decode_from_head(raw)
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
            self.drop(msg.request_id, msg.generation, msg.reason)
        elif isinstance(msg, P.PeerDown):
            self.endpoint.reclaim_peer(msg.instance_id)
        elif isinstance(msg, P.PushTask):
            self.start_push(msg)
        elif isinstance(msg, P.RegisterAck):
            logger.warning("%s got an unexpected RegisterAck: %s", self.instance_id, msg.reason)
        else:
            try:
                self.runner.accept(msg)
            except P.ProtocolError as e:
                logger.warning("%s: %s", self.instance_id, e)

    # ---- transfers ----------------------------------------------------------------------------
    def submit(self, request_id: str, generation: int, what: str, fn, *args) -> None:
        self._pending.append((self._pool.submit(fn, *args), request_id, generation, what))

    def reserve(self, job: Job, handoff: str, specs: dict[str, P.TensorSpec], source: str, timeout_s: float) -> None:
        """Reserve receiver slots for a handoff, tell the head, and wait for the push off-loop."""
        prefix = f"{job.request_id}/g{job.generation}/{handoff}"
        wanted = {k: (dtype_from_name(s.dtype), s.shape) for k, s in specs.items()}
        refs = self.endpoint.reserve_bundle(prefix, wanted, peer=source, timeout_s=timeout_s)
        job.reserved = [r.transfer_id for r in refs.values()]
        self.send(P.SlotsReserved(job.request_id, job.generation, self.instance_id, handoff, refs))
        self.submit(job.request_id, job.generation, "arrived", self.endpoint.wait_bundle, refs)

    def start_push(self, msg: P.PushTask) -> None:
        job = self.jobs.get(msg.request_id)
        if job is None or job.generation != msg.generation or job.outgoing is None:
            logger.debug("%s: stale PushTask %s g%d", self.instance_id, msg.request_id, msg.generation)
            return
        tensors, job.outgoing = job.outgoing, None
        self.submit(
            msg.request_id, msg.generation, f"pushed:{msg.handoff}", self.endpoint.push_bundle, msg.refs, tensors
        )

    def collect(self) -> None:
        """Hand finished transfer futures to their jobs; results of dropped jobs are discarded."""
        done = [p for p in self._pending if p[0].done()]
        self._pending = [p for p in self._pending if not p[0].done()]
        for future, rid, gen, what in done:
            job = self.jobs.get(rid)
            current = job is not None and job.generation == gen
            try:
                result = future.result()
            except TransferError as e:
                if current:
                    self.fail(job, e, retryable=True)
                continue
            if not current:
                continue
            if what == "arrived":
                job.reserved = []
                self.runner.arrived(job, result)
            else:
                self.jobs.pop(rid, None)
                self.send(P.PushDone(rid, gen, self.instance_id, what.split(":", 1)[1]))

    # ---- request bookkeeping ------------------------------------------------------------------
    def fail(self, job: Job, error: Exception, retryable: bool) -> None:
        logger.warning("%s: %s g%d failed: %s", self.instance_id, job.request_id, job.generation, error)
        self.drop(job.request_id, job.generation, "failed")
        invalid = None
        if isinstance(error, InvalidParam):  # the request broke a rule only this worker could check
            invalid = (error.field, repr(error.value)[:80], error.rule)
        stage = "chat" if isinstance(job.task, P.ChatTask) else self.runner.stage
        self.send(
            P.StageError(
                job.request_id,
                job.generation,
                self.instance_id,
                stage,
                type(error).__name__,
                str(error),
                retryable,
                invalid,
            )
        )

    def rejoin(self, reason: str) -> None:
        """The head no longer counts us (it declared us dead and retried our requests elsewhere):
        drop every job, let transfers already running end, and register again under the same id."""
        logger.warning(
            "%s: the head asks us to rejoin (%s); dropping %d job(s)", self.instance_id, reason, len(self.jobs)
        )
        for rid, job in list(self.jobs.items()):
            self.drop(rid, job.generation, "rejoining the head")
        futures_wait([f for f, *_ in self._pending], timeout=self.config.register_timeout_s)
        self._pending = []
        try:
            self.register()
        except RegistrationRefused as e:
            logger.error("%s: could not rejoin: %s", self.instance_id, e)
            self._stop.set()

    def drop(self, request_id: str, generation: int, reason: str) -> None:
        """Free everything held for this request generation (slots, tensors, engine state)."""
        job = self.jobs.get(request_id)
        if job is None or job.generation > generation:
            return
        del self.jobs[request_id]
        for transfer_id in job.reserved:
            self.endpoint.cancel(transfer_id)
        self.runner.abort(job)
        logger.info("%s dropped %s g%d (%s)", self.instance_id, request_id, generation, reason)

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """A ``Shutdown`` (or ``stop()``) arrived: long work (a chat answer) ends early."""
        return self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        for rid, job in list(self.jobs.items()):
            self.drop(rid, job.generation, "worker closing")
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.endpoint.close()
        self._sock.close(linger=0)
        self._ctx.term()


def run_worker(config: WorkerConfig) -> int:
    """Process entry: build, register, serve until shutdown. Returns the exit code."""
    worker = Worker(config)
    try:
        worker.run()
    except RegistrationRefused as e:
        logger.error("%s", e)
        return 3
    return 0
