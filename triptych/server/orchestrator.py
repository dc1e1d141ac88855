"""The head's disaggregated backend: routes each job through the encoder, denoiser and decoder pools.

Ownership contract:
- The orchestrator owns every request's ``RequestMachine`` and every instance slot it charged
  (``Instance.held``). Workers own tensors and transfer slots; the head only ever sees specs and
  ``TensorRef`` handles (and the final media bytes).
- Backpressure: a request starts encoding only once an encoder *and* a denoiser slot are charged
  to it, and its denoise task is sent only once a decoder slot is charged, so no stage starts work
  whose output has nowhere to go. Each wait is its own per-role queue (``_wait_encode``,
  ``_wait_decoder``) so a request waiting for a decoder never holds up one waiting for an encoder.
- A slot is freed when its tensors left the instance (``PushDone``), the request ended, or the
  instance died. Ending a request any other way than DONE also sends ``Cancel`` to every worker
  still holding something of it.
- A dead instance (silent past ``heartbeat_timeout_s``) is removed; every live peer is told to
  reclaim its transfer slots; each request it was serving is retried once elsewhere under a new
  generation. Messages of an older generation are counted and dropped.
- Stats: at each stage end the orchestrator hands a ``StageStats`` (queue wait and run time as the
  head sees them) to ``metrics``; each worker's cumulative ``StatsReport`` becomes a ``StatsWindow``
  of deltas against the instance's previous one (``worker_stats``), handed to ``metrics`` too.
All state lives on the asyncio loop that called ``start``; nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio

from triptych.pipelines.base import Role
from triptych.server import metrics
from triptych.server import protocol as P
from triptych.server.backend import Cancelled, GenerationBackend, GenerationJob, Overloaded, ProgressFn, StageFailed
from triptych.server.chat_routing import ChatRouting
from triptych.server.dispatch import Instance, bound_ids, make_policy
from triptych.server.request_state import RequestMachine, RequestState, StateTimeouts
from triptych.server.worker_stats import stats_window

logger = logging.getLogger(__name__)
S = RequestState
ROLES = tuple(r.value for r in Role)


@dataclass(frozen=True)
class OrchestratorConfig:
    """The head's control plane."""

    host: str = "127.0.0.1"
    """Address the control socket binds; workers connect to ``tcp://host:control_port``."""
    control_port: int = 0
    """Control port; 0 = a free port chosen at start (see ``Orchestrator.control_address``)."""
    dispatch: str = "round_robin"
    """Instance choice per role: round_robin | max_free_slots."""
    heartbeat_interval_s: float = 0.5
    """How often workers report (sent to them in ``RegisterAck``)."""
    heartbeat_timeout_s: float = 5.0
    """An instance silent this long is declared dead."""
    timeouts: StateTimeouts = field(default_factory=StateTimeouts)
    """Longest stay in each request state."""
    max_retries: int = 1
    """Retries of a request after the instance serving it died (or failed retryably)."""
    max_queued: int = 256
    """Admission: more queued requests than this raise ``Overloaded``."""
    reserve_timeout_s: float = 60.0
    """How long a receiver keeps slots reserved waiting for the upstream push."""
    chat_timeout_s: float = 600.0
    """Longest a chat may take from arrival to its last token (queue wait included)."""

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed 2 x heartbeat_interval_s="
                f"{self.heartbeat_interval_s}, or live workers get declared dead"
            )
        if self.max_retries < 0 or self.max_queued < 1 or self.reserve_timeout_s <= 0 or self.chat_timeout_s <= 0:
            raise ValueError("max_retries must be >= 0, max_queued >= 1, reserve_timeout_s and chat_timeout_s > 0")
        make_policy(self.dispatch)  # raises on an unknown name


@dataclass
class Tracked:
    """One live request on the head."""

    job: GenerationJob
    machine: RequestMachine
    future: asyncio.Future
    on_progress: ProgressFn | None
    wire: P.WireParams
    assigned: dict[str, str] = field(default_factory=dict)  # role -> instance id charged a slot
    cond_specs: dict[str, P.TensorSpec] | None = None
    retries: int = 0
    avoid: dict[str, set[str]] = field(default_factory=dict)  # role -> instances that failed this request
    waited_s: float = 0.0  # queue wait of the current stage (reported with its run time at its end)
    encoded_at: float = 0.0  # monotonic time of EncodeDone: the wait for a decoder slot starts


class Orchestrator(ChatRouting, GenerationBackend):
    """``GenerationBackend`` over registered worker pools (see the module docstring)."""

    def __init__(self, model_dir: str | Path, config: OrchestratorConfig | None = None):
        from triptych.pipelines.registry import family_class
        from triptych.server.worker import model_revision

        self.config = config or OrchestratorConfig()
        self.model_dir = Path(model_dir)
        self.family = family_class(self.model_dir)(self.model_dir, roles=())  # weightless: validation only
        self.revision = model_revision(self.model_dir)
        self.instances: dict[str, Instance] = {}
        self.stats: Counter[str] = Counter()
        self._identity: dict[str, bytes] = {}
        self._rejoin_sent: dict[str, float] = {}  # unknown instance id -> when it was last told to rejoin
        self._last_stats: dict[str, tuple[int, P.StatsReport]] = {}  # dead instance -> (pid, last report)
        self._policies = {role: make_policy(self.config.dispatch) for role in ROLES}
        self._requests: dict[str, Tracked] = {}
        self._wait_encode: deque[str] = deque()
        self._init_chats()
        self._wait_decoder: deque[str] = deque()
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self.control_address = ""
        self._handlers = {
            P.EncodeDone: self._on_encode_done,
            P.SlotsReserved: self._on_slots_reserved,
            P.PushDone: self._on_push_done,
            P.Progress: self._on_progress,
            P.DenoiseDone: self._on_denoise_done,
            P.MediaResult: self._on_media,
            P.StageError: self._on_stage_error,
        }

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self.config.control_port
        self._sock.bind(f"tcp://{self.config.host}:{port or '*'}")
        self.control_address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._tick_loop())]
        logger.info("orchestrator control plane at %s (revision %s)", self.control_address, self.revision)

    async def close(self) -> None:
        for tr in list(self._requests.values()):
            self._finish(tr, S.CANCELLED, error=Cancelled(f"{tr.job.request_id}: server shutting down"))
        self._end_chats(lambda ct: True, lambda ct: Cancelled(f"{ct.job.request_id}: server shutting down"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=1000)  # lets queued Shutdown/Cancel messages go out
            self._ctx.term()
            self._sock = None

    def shutdown_workers(self, reason: str = "head shutting down") -> None:
        for iid in list(self.instances):
            self._send(iid, P.Shutdown(reason))

    async def wait_for_instances(self, counts: dict[str, int], timeout_s: float) -> None:
        """Block until at least ``counts[role]`` instances of each role registered."""
        end = time.monotonic() + timeout_s
        while (missing := {r: n for r, n in counts.items() if len(self.pool(r)) < n}) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if missing:
            raise TimeoutError(f"workers missing after {timeout_s}s: {missing} (have {self.describe()['instances']})")

    def pool(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role]

    # ---- GenerationBackend --------------------------------------------------------------------
    async def run(self, job: GenerationJob, on_progress: ProgressFn | None = None) -> bytes:
        rid = job.request_id
        assert self._sock is not None, "Orchestrator.start() was not called"
        if len(self._wait_encode) >= self.config.max_queued:
            raise Overloaded(f"queue is full ({self.config.max_queued} requests)", retry_after=1.0)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already running")
        future = asyncio.get_running_loop().create_future()
        wire = P.params_to_wire(job.params)
        tr = Tracked(job, RequestMachine(rid, self.config.timeouts), future, on_progress, wire)
        self._requests[rid] = tr
        self._wait_encode.append(rid)
        self._pump()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the caller went away (client disconnect): free everything
            await self.cancel(rid)
            if not future.cancelled():
                future.exception()  # retrieved: nobody else will
            raise

    async def cancel(self, request_id: str) -> bool:
        if self._end_chats(lambda ct: ct.job.request_id == request_id, lambda ct: Cancelled(request_id)):
            return True
        tr = self._requests.get(request_id)
        if tr is None:
            return False
        self._finish(tr, S.CANCELLED, error=Cancelled(request_id))
        return True

    def describe(self) -> dict:
        return {
            "control": self.control_address,
            "revision": self.revision,
            "instances": [
                {
                    "id": i.instance_id,
                    "role": i.role,
                    "state": "busy" if i.held else "idle",
                    "capacity": i.capacity,
                    "free": i.free,
                    "held": sorted(i.held),
                    "assigned": i.assigned,
                    "transfer": i.transfer,
                    "pid": i.pid,
                    "report": dict(i.report),
                }
                for i in sorted(self.instances.values(), key=lambda i: i.instance_id)
            ],
            "requests": dict(Counter(t.machine.state.value for t in self._requests.values())),
            "chats": len(self._chats),
            "queues": {
                "encode": len(self._wait_encode),
                "decoder": len(self._wait_decoder),
                "chat": len(self._wait_chat),
            },
            "stats": dict(self.stats),
        }

    # ---- control socket -----------------------------------------------------------------------
    def _send(self, instance_id: str, msg: P.Message) -> None:
        identity = self._identity.get(instance_id)
        if identity is not None and self._sock is not None:
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
            self._on_message(frames[0], msg)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.1, self.config.heartbeat_interval_s / 2))
            now = time.monotonic()
            for inst in [i for i in self.instances.values() if now - i.last_seen > self.config.heartbeat_timeout_s]:
                self._on_instance_dead(inst.instance_id, f"silent for {now - inst.last_seen:.1f}s")
            for tr in [t for t in self._requests.values() if t.machine.expired(now)]:
                state = tr.machine.state
                limit = tr.machine.timeouts.for_state(state)
                self._finish(tr, S.TIMED_OUT, error=StageFailed(f"request timed out in {state.value} after {limit}s"))
            self._end_chats(
                lambda ct: now > ct.deadline,
                lambda ct: StageFailed(f"chat timed out after {self.config.chat_timeout_s}s"),
            )
            self._pump()

    def _on_message(self, identity: bytes, msg: P.WorkerMessage) -> None:
        if isinstance(msg, P.Register):
            return self._on_register(identity, msg)
        inst = self.instances.get(msg.instance_id)
        if inst is None:
            self.stats["from_unknown_instance"] += 1
            logger.debug("message from unknown instance %s dropped", msg.instance_id)
            self._tell_rejoin(msg.instance_id)
            return
        inst.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat):
            inst.report = {f: getattr(msg, f) for f in msg.__struct_fields__ if f != "instance_id"}
            return
        if isinstance(msg, P.StatsReport):
            metrics.record_worker_window(stats_window(inst.role, inst.stats, msg))
            inst.stats = msg
            return
        if msg.request_id in self._chats or isinstance(msg, (P.ChatDelta, P.ChatDone)):
            self._on_chat_message(msg)
            self._pump()
            return
        tr = self._requests.get(msg.request_id)
        if tr is None or tr.machine.generation != msg.generation:
            # NOTE: a PushDone racing the MediaResult of a finished request lands here too.
            self.stats["dropped_after_end" if tr is None else "dropped_stale"] += 1
            logger.debug("dropped stale %s for %s g%d", type(msg).__name__, msg.request_id, msg.generation)
            return
        self._handlers[type(msg)](tr, msg)
        self._pump()

    def _tell_rejoin(self, instance_id: str) -> None:
        """An instance we do not know is alive (declared dead while only silent, e.g. a stalled
        process or a partition): tell it to drop its jobs and register again, once per interval."""
        now = time.monotonic()
        if now - self._rejoin_sent.get(instance_id, -1e9) < self.config.heartbeat_interval_s:
            return
        self._rejoin_sent[instance_id] = now
        bound_ids(self._rejoin_sent)
        self.stats["rejoins_requested"] += 1
        logger.warning("%s is alive but not registered (declared dead earlier?); asking it to rejoin", instance_id)
        if self._sock is not None:
            self._sock.send_multipart([instance_id.encode(), P.encode(P.Rejoin("not registered with this head"))])

    def _on_register(self, identity: bytes, m: P.Register) -> None:
        reason = None
        if m.revision != self.revision:
            reason = f"model revision {m.revision} != head's {self.revision}: start the worker with the head's --model"
        elif m.instance_id in self.instances:
            reason = f"instance id {m.instance_id!r} is already registered"
        if reason is None:
            self._identity[m.instance_id] = identity
            self._rejoin_sent.pop(m.instance_id, None)
            inst = Instance(
                m.instance_id, m.role, m.capacity, m.control, m.data, m.transfer, m.pid, time.monotonic(), chat=m.chat
            )
            last = self._last_stats.pop(m.instance_id, None)
            if last is not None and last[0] == m.pid:  # the same process rejoining: its counters continue
                inst.stats = last[1]
            self.instances[m.instance_id] = inst
            logger.info(
                "registered %s %s (capacity %d, %s at %s)", m.role, m.instance_id, m.capacity, m.transfer, m.data
            )
            self._pump()
        else:
            logger.warning("refused %s: %s", m.instance_id, reason)
        self._sock.send_multipart(
            [identity, P.encode(P.RegisterAck(m.instance_id, reason is None, reason, self.config.heartbeat_interval_s))]
        )

    # ---- request flow -------------------------------------------------------------------------
    def _from(self, tr: Tracked, role: str, m) -> bool:
        if tr.assigned.get(role) == m.instance_id:
            return True
        self.stats["dropped_misrouted"] += 1
        logger.debug(
            "%s for %s from %s, expected %s %s",
            type(m).__name__,
            tr.job.request_id,
            m.instance_id,
            role,
            tr.assigned.get(role),
        )
        return False

    def _pump(self) -> None:
        """Start whatever the free slots allow: encodes (encoder + denoiser slot), then denoises (decoder
        slot), then chats (a slot of a chat-capable encoder)."""
        self._pump_generations()
        self._pump_chats()

    def _pump_generations(self) -> None:
        while self._wait_encode:
            placed = self._place_encode()
            if placed is None:
                break
            tr, enc, den = placed
            self._charge(tr, enc)
            self._charge(tr, den)
            now = time.monotonic()
            tr.waited_s = now - tr.machine.entered_at
            tr.machine.to(S.ENCODING, now)
            self._send(
                enc.instance_id, P.EncodeTask(tr.job.request_id, tr.machine.generation, tr.wire, den.instance_id)
            )
        while self._wait_decoder:
            tr = self._requests[self._wait_decoder[0]]
            dec = self._pick("decoder", tr)
            if dec is None:
                break
            self._wait_decoder.popleft()
            self._charge(tr, dec)
            now = time.monotonic()
            tr.waited_s = now - tr.encoded_at
            tr.machine.to(S.DENOISING, now)
            self._send(
                tr.assigned["denoiser"],
                P.DenoiseTask(
                    tr.job.request_id,
                    tr.machine.generation,
                    tr.wire,
                    tr.cond_specs,
                    tr.assigned["encoder"],
                    dec.instance_id,
                    self.config.reserve_timeout_s,
                ),
            )

    def _place_encode(self) -> tuple[Tracked, Instance, Instance] | None:
        """The first waiting request (in order) that an encoder and a denoiser slot can take now.

        A retried request may avoid instances that failed it, so it can wait while one behind it
        starts; the first request with nothing to avoid that cannot start ends the search (every
        later one would fail the same way), so order holds among ordinary requests."""
        for rid in self._wait_encode:
            tr = self._requests[rid]
            enc = self._pick("encoder", tr)
            den = enc and self._pick("denoiser", tr)
            if enc is not None and den is not None:
                self._wait_encode.remove(rid)
                return tr, enc, den
            if not tr.avoid:
                return None
        return None

    def _pick(self, role: str, tr: Tracked) -> Instance | None:
        """The policy's choice among the role's instances, leaving out those that failed this request
        while any other is registered (it waits for that one's free slot rather than go back)."""
        pool = self.pool(role)
        avoid = frozenset(tr.avoid.get(role, ()))
        if avoid and all(i.instance_id in avoid for i in pool):
            avoid = frozenset()
        return self._policies[role].pick(pool, exclude=avoid)

    def _charge(self, tr: Tracked, inst: Instance) -> None:
        inst.hold(tr.job.request_id)
        tr.assigned[inst.role] = inst.instance_id

    def _uncharge(self, tr: Tracked, role: str) -> None:
        iid = tr.assigned.pop(role, None)
        if iid is not None and iid in self.instances:
            self.instances[iid].unhold(tr.job.request_id)

    def _on_encode_done(self, tr: Tracked, m: P.EncodeDone) -> None:
        if self._from(tr, "encoder", m) and tr.machine.state is S.ENCODING and tr.cond_specs is None:
            tr.cond_specs = m.specs
            tr.encoded_at = self._stage_done(tr, "encode")
            self._wait_decoder.append(tr.job.request_id)

    def _on_slots_reserved(self, tr: Tracked, m: P.SlotsReserved) -> None:
        receiver, sender = ("denoiser", "encoder") if m.handoff == "cond" else ("decoder", "denoiser")
        if self._from(tr, receiver, m) and sender in tr.assigned:
            self._send(tr.assigned[sender], P.PushTask(m.request_id, m.generation, m.handoff, m.refs))

    def _on_push_done(self, tr: Tracked, m: P.PushDone) -> None:
        sender = "encoder" if m.handoff == "cond" else "denoiser"
        if self._from(tr, sender, m):
            self._uncharge(tr, sender)

    def _on_progress(self, tr: Tracked, m: P.Progress) -> None:
        if tr.on_progress is not None and self._from(tr, "denoiser", m):
            tr.on_progress(m.step, m.total)

    def _on_denoise_done(self, tr: Tracked, m: P.DenoiseDone) -> None:
        if self._from(tr, "denoiser", m) and tr.machine.state is S.DENOISING:
            tr.waited_s = 0.0  # the decoder slot was charged before denoising started
            tr.machine.to(S.DECODING, self._stage_done(tr, "denoise"))
            job = tr.job
            self._send(
                tr.assigned["decoder"],
                P.DecodeTask(
                    job.request_id,
                    m.generation,
                    tr.wire,
                    m.specs,
                    m.instance_id,
                    job.output_format,
                    job.fps,
                    self.config.reserve_timeout_s,
                    job.quality,
                ),
            )

    def _on_media(self, tr: Tracked, m: P.MediaResult) -> None:
        if self._from(tr, "decoder", m) and tr.machine.state is S.DECODING:
            self._stage_done(tr, "decode")
            self._finish(tr, S.DONE, result=m.data)

    def _stage_done(self, tr: Tracked, stage: str) -> float:
        """Report the stage that just ended (its queue wait and its run time); returns now."""
        now = time.monotonic()
        metrics.record_stage(metrics.StageStats(stage, tr.waited_s, now - tr.machine.entered_at))
        return now

    def _on_stage_error(self, tr: Tracked, m: P.StageError) -> None:
        if m.instance_id not in tr.assigned.values():
            return
        what = f"{m.stage} failed on {m.instance_id}: {m.message}"
        if m.retryable:
            self._retry(tr, what, exclude=m.instance_id)
        else:
            self._finish(tr, S.FAILED, error=StageFailed(what))

    # ---- endings, retries, deaths -------------------------------------------------------------
    def _finish(
        self, tr: Tracked, state: RequestState, result: bytes | None = None, error: Exception | None = None
    ) -> None:
        rid = tr.job.request_id
        tr.machine.to(state)
        self._release(tr, cancel_workers=state is not S.DONE, reason=state.value)
        del self._requests[rid]
        self.stats[state.value] += 1
        if not tr.future.done():
            tr.future.set_exception(error) if error is not None else tr.future.set_result(result)
        logger.info("request %s %s (generation %d)", rid, state.value, tr.machine.generation)

    def _release(self, tr: Tracked, cancel_workers: bool, reason: str) -> None:
        rid = tr.job.request_id
        for q in (self._wait_encode, self._wait_decoder):
            if rid in q:
                q.remove(rid)
        for role, iid in list(tr.assigned.items()):
            if cancel_workers:
                self._send(iid, P.Cancel(rid, tr.machine.generation, reason))
            self._uncharge(tr, role)
        tr.cond_specs = None

    def _retry(self, tr: Tracked, why: str, exclude: str | None = None) -> None:
        role = next((r for r, i in tr.assigned.items() if i == exclude), None)
        if tr.retries >= self.config.max_retries:
            return self._finish(tr, S.FAILED, error=StageFailed(f"{why}; retries exhausted ({tr.retries})"))
        if role is not None and not [i for i in self.pool(role) if i.instance_id != exclude]:
            return self._finish(tr, S.FAILED, error=StageFailed(f"{why}; no other {role} instance is registered"))
        self._release(tr, cancel_workers=True, reason=f"retry: {why}")
        if role is not None:
            tr.avoid.setdefault(role, set()).add(exclude)
        tr.retries += 1
        tr.machine.to(S.QUEUED)
        self._wait_encode.appendleft(tr.job.request_id)
        self.stats["retries"] += 1
        logger.warning("retrying %s as generation %d: %s", tr.job.request_id, tr.machine.generation, why)

    def _on_instance_dead(self, instance_id: str, why: str) -> None:
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return
        self.stats["instances_lost"] += 1
        metrics.forget_instance(instance_id)
        logger.warning("%s %s declared dead (%s); %d requests affected", inst.role, instance_id, why, len(inst.held))
        for other in list(self.instances):
            self._send(other, P.PeerDown(instance_id))
        self._identity.pop(instance_id, None)
        if inst.stats is not None:
            self._last_stats[instance_id] = (inst.pid, inst.stats)
            bound_ids(self._last_stats)
        for tr in [t for t in self._requests.values() if instance_id in t.assigned.values()]:
            self._retry(tr, f"{inst.role} {instance_id} died ({why})", exclude=instance_id)
        self._retry_chats_on(instance_id, f"{inst.role} {instance_id} died ({why})")
        self._pump()
