"""The head's disaggregated backend: composes the control plane, the instance registry and the two
routers (generations, chats), and decides what an instance's death means for each.

- ``control.ControlPlane``: the ROUTER socket, typed messages in and out.
- ``registry.InstanceRegistry``: registration, heartbeats, stats windows, silence → death.
- ``routing.GenerationRouter``: each generation through encoder → denoiser → decoder, with
  backpressure, retries and the request state machine (its docstring has the ownership contract).
- ``chat_router.ChatRouter``: each chat on one chat-capable encoder, same machine and retry code.

A dead instance (silent past ``heartbeat_timeout_s``) is removed; every live peer is told to reclaim
its transfer slots; each request it was serving is retried elsewhere under a new generation, or,
with no other instance of that role, on the first one to register within ``replacement_wait_s`` and
the request's deadline (``replacement``).
All state lives on the asyncio loop that called ``start``; nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from triptych.chat import ChatResult
from triptych.control import deadlines, wire
from triptych.control import protocol as P
from triptych.control.auth import ControlKey, new_token
from triptych.control.backend import (
    Cancelled,
    ChatJob,
    GenerationBackend,
    GenerationJob,
    PreviewFn,
    ProgressFn,
    TextFn,
    Unavailable,
)
from triptych.control.chat_router import ChatRouter
from triptych.control.counters import HeadCounters
from triptych.control.dispatch import Instance, make_policy
from triptych.control.listener import ControlPlane
from triptych.control.metrics import Metrics
from triptych.control.registry import InstanceRegistry
from triptych.control.request_state import StateTimeouts
from triptych.control.routing import GenerationRouter
from triptych.control.step_costs import StepCosts
from triptych.core import offload
from triptych.core.errors import InvalidParam
from triptych.core.kinds import ROLES, Role
from triptych.core.startup import startup_log

logger = logging.getLogger(__name__)


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
    """Requests waiting for their first slot (generation: an encoder's, all models together; chat: a
    VLM's, a queue of its own) past which ``Overloaded`` is raised. A backstop: the HTTP head refuses
    first, per model, at ``AdmissionLimits.max_queued_requests`` (jobs queued or running); this bounds
    what reaches the orchestrator by any other caller."""
    reserve_timeout_s: float = 60.0
    """How long a receiver keeps slots reserved waiting for the upstream push."""
    chat_timeout_s: float = 600.0
    """Longest a chat answer may take from its first token to its last."""
    replacement_wait_s: float = 120.0
    """A request whose instance died while no other instance of that role is registered waits this
    long for one to register (a supervisor's restart: the backoff, then loading the model) before it
    fails; 0 = fail at once. The request's own deadline (``request_timeout_s``) cuts it shorter, as
    do the state timeouts it waits in (``timeouts.queued_s``; ``encoding_s`` once encoded again,
    waiting for a decoder). Such a request holds no slot of the dead attempt while it waits, and it
    is not failed by ``unavailable_after_s`` (new requests are)."""
    unavailable_after_s: float = 30.0
    """A role with no live instance for this long (and no local worker of it starting: a spawn or a
    restart restarts the count) makes new and queued requests that need it fail at once (HTTP 503 +
    Retry-After) instead of waiting out the queue timeout."""
    slo_prior_step_s: float = 0.5
    """Seconds one denoising step of a size not measured yet is assumed to take, when a request's
    ``deadline_s`` is checked against the work queued ahead of it (``step_costs``); each size's own
    cost replaces it from the first request of that size that finished (the denoiser reports its
    time). A deadline the estimate cannot meet is refused at once (429). Bounds: > 0."""
    token: str = ""
    """The deployment's control-plane token: only workers holding it register, every control frame
    is signed with it. Empty = a fresh random one (``Orchestrator.token``), for local workers."""

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed 2 x heartbeat_interval_s="
                f"{self.heartbeat_interval_s}, or live workers get declared dead"
            )
        if not self.slo_prior_step_s > 0:
            raise ValueError(f"slo_prior_step_s={self.slo_prior_step_s} must be > 0")
        if self.unavailable_after_s <= 0:
            raise ValueError(f"unavailable_after_s={self.unavailable_after_s} must be > 0")
        if self.replacement_wait_s < 0:
            raise ValueError(f"replacement_wait_s={self.replacement_wait_s} must be >= 0 (0: fail at once)")
        if self.max_retries < 0 or self.max_queued < 1 or self.reserve_timeout_s <= 0 or self.chat_timeout_s <= 0:
            raise ValueError("max_retries must be >= 0, max_queued >= 1, reserve_timeout_s and chat_timeout_s > 0")
        make_policy(self.dispatch)  # raises on an unknown name


@dataclass(frozen=True)
class PoolLoad:
    """One role's pool as a scaler sees it (``Orchestrator.load``)."""

    queue_depth: int  # requests waiting for a slot of this role (0 while a live instance has a free one)
    oldest_wait_s: float  # how long the first of those has waited (0 when none waits)
    live: tuple[str, ...]  # registered instances taking new work (not draining)
    idle: tuple[str, ...]  # of ``live``, those holding no request
    draining: dict[str, int]  # draining instance -> requests it still holds


def pool_load(pool: list[Instance], generations, chats, role: Role, now: float) -> PoolLoad:
    """``role``'s ``pool`` as a scaler sees it: ``generations``' and ``chats``' backlogs (their
    ``backlog(now)``) count as waiting only while no live instance has a free slot."""
    live = [i for i in pool if not i.draining]
    depth, wait = generations.backlog(now)["decoder" if role == Role.DECODER else "encode"]
    if any(i.free > 0 for i in live):
        depth, wait = 0, 0.0
    if role == Role.ENCODER and not any(i.chat_free > 0 for i in live if i.chat):  # chats wait for encoders too
        chats_waiting, chat_wait = chats.backlog(now)
        depth, wait = depth + chats_waiting, max(wait, chat_wait)
    return PoolLoad(
        depth,
        wait if depth else 0.0,
        tuple(sorted(i.instance_id for i in live)),
        tuple(sorted(i.instance_id for i in live if not i.held)),
        {i.instance_id: len(i.held) for i in pool if i.draining},
    )


def generation_router(
    c: OrchestratorConfig, registry, send, metrics, counters, clock=time.monotonic
) -> GenerationRouter:
    """The ``GenerationRouter`` an orchestrator with config ``c`` routes generations with (a
    simulator passes its virtual ``clock``)."""
    return GenerationRouter(
        registry=registry,
        send=send,
        metrics=metrics,
        counters=counters,
        timeouts=c.timeouts,
        max_retries=c.max_retries,
        max_queued=c.max_queued,
        reserve_timeout_s=c.reserve_timeout_s,
        replacement_wait_s=c.replacement_wait_s,
        costs=StepCosts(prior_s=c.slo_prior_step_s),
        clock=clock,
    )


class Orchestrator(GenerationBackend):
    """``GenerationBackend`` over registered worker pools (see the module docstring)."""

    def __init__(self, model_dir: str | Path, config: OrchestratorConfig | None = None, metrics: Metrics | None = None):
        from triptych.core.identity import model_revision
        from triptych.families.registry import family_class

        self.config = c = config or OrchestratorConfig()
        self.model_dir = Path(model_dir)
        self.family = family_class(self.model_dir)(self.model_dir, roles=())  # weightless: validation only
        self.revision = model_revision(self.model_dir)
        self.metrics = metrics or Metrics()
        self.counters = counts = HeadCounters()
        self.token = c.token or new_token()
        self.control = ControlPlane(c.host, c.control_port, ControlKey(self.token), counts.control, self._on_message)
        self.registry = InstanceRegistry(
            self.revision, c.dispatch, c.heartbeat_interval_s, self.control, self.metrics, counts.registry
        )
        send = self.control.send
        self.generations = generation_router(c, self.registry, send, self.metrics, counts.generations)
        self.chats = ChatRouter(
            registry=self.registry,
            send=send,
            counters=counts.chats,
            timeouts=dataclasses.replace(c.timeouts, chatting_s=c.chat_timeout_s),
            max_retries=c.max_retries,
            max_queued=c.max_queued,
        )
        self._tick: asyncio.Task | None = None

    @property
    def control_address(self) -> str:
        return self.control.address

    @property
    def instances(self) -> dict[str, Instance]:
        return self.registry.instances

    def pool(self, role: Role) -> list[Instance]:
        return self.registry.pool(role)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.control.start()
        self._tick = asyncio.create_task(self._tick_loop())
        logger.info("orchestrator control plane at %s (revision %s)", self.control_address, self.revision)

    async def close(self) -> None:
        self.generations.end_all(lambda rid: Cancelled(f"{rid}: server shutting down"))
        self.chats.end_all(lambda rid: Cancelled(f"{rid}: server shutting down"))
        if self._tick is not None:
            self._tick.cancel()
            await asyncio.gather(self._tick, return_exceptions=True)
            self._tick = None
        await self.control.close()

    def shutdown_workers(self, reason: str = "head shutting down") -> None:
        for iid in list(self.registry.instances):
            self.control.send(iid, P.Shutdown(reason=reason))

    def stop(self, instance_id: str, reason: str) -> None:
        """Tell one worker to shut down (a drained instance being scaled in)."""
        self.control.send(instance_id, P.Shutdown(reason=reason))

    async def wait_for_instances(self, counts: dict[str, int], timeout_s: float) -> None:
        """Block until at least ``counts[role]`` instances of each role registered."""
        t0 = time.monotonic()
        end = t0 + timeout_s
        seen: set[str] = set()
        model = Path(self.model_dir).name
        while True:
            for role in counts:
                for inst in self.pool(role):
                    if inst.instance_id not in seen:
                        seen.add(inst.instance_id)
                        startup_log.info(
                            "%s: %s worker %s ready (%.1fs)", model, role, inst.instance_id, time.monotonic() - t0
                        )
            missing = {r: n for r, n in counts.items() if len(self.pool(r)) < n}
            if not missing or time.monotonic() >= end:
                break
            await asyncio.sleep(0.05)
        if missing:
            raise TimeoutError(f"workers missing after {timeout_s}s: {missing} (have {self.describe()['instances']})")

    # ---- GenerationBackend --------------------------------------------------------------------
    async def run(
        self, job: GenerationJob, on_progress: ProgressFn | None = None, on_preview: PreviewFn | None = None
    ) -> bytes:
        assert self.control.open, "Orchestrator.start() was not called"
        self._check_new(job.request_id)
        self._check_available(ROLES)
        wire_params = None
        if job.params.image is not None:  # its PNG encode: seconds for a large image, not on the loop
            wire_params = await offload.run(wire.params_to_wire, job.params)
        future = self.generations.submit(job, on_progress, on_preview, wire_params)
        return await self._await(job.request_id, future)

    def check_deadlines(self, jobs: list[GenerationJob]) -> None:
        deadlines.check(self.generations, jobs, time.monotonic())

    async def chat(self, job: ChatJob, on_text: TextFn | None = None) -> ChatResult:
        assert self.control.open, "Orchestrator.start() was not called"
        if not self.family.supports_chat:
            raise InvalidParam("model", self.model_dir.name, "this model has no VLM to chat with")
        self._check_new(job.request_id)
        self._check_available((Role.ENCODER,))
        if wire.small_images(job.params):
            images_png = wire.chat_images(job.params)
        else:  # a large image's PNG encode takes seconds: not on the loop
            images_png = await offload.run(wire.chat_images, job.params)
        future = self.chats.submit(job, on_text, images_png)
        return await self._await(job.request_id, future)

    async def cancel(self, request_id: str) -> bool:
        return self.chats.cancel(request_id) or self.generations.cancel(request_id)

    def load(self, role: Role, now: float) -> PoolLoad:
        """The pool of ``role`` and the requests waiting for it (see ``PoolLoad``)."""
        return pool_load(self.registry.pool(role), self.generations, self.chats, role, now)

    def drain(self, instance_id: str) -> bool:
        """Route no new request to ``instance_id``; what it holds runs to the end. False if unknown."""
        inst = self.registry.instances.get(instance_id)
        if inst is None:
            return False
        inst.draining = True
        logger.info("%s %s draining (%d requests held)", inst.role, instance_id, len(inst.held))
        return True

    def describe(self) -> dict:
        gen, chats = self.generations.describe(), self.chats.describe()
        return {
            "control": self.control_address,
            "revision": self.revision,
            "instances": self.registry.describe(),
            "empty_roles": self.registry.empty_roles(),
            "requests": gen["requests"],
            "chats": chats["chats"],
            "queues": {**gen["queues"], "chat": chats["queue"]},
            "tenants": {"generation": gen["tenants"], "chat": chats["tenants"]},
            "stats": self.counters.labels(),
        }

    def _unavailable(self, roles) -> Unavailable | None:
        missing = self.registry.missing(time.monotonic(), self.config.unavailable_after_s)
        gone = {r: s for r, s in missing.items() if r in roles}
        if not gone:
            return None
        what = ", ".join(f"{r} (none for {s:.0f}s)" for r, s in sorted(gone.items()))
        return Unavailable(f"no live instance of a role this request needs: {what}", retry_after=5.0)

    def _check_available(self, roles) -> None:
        error = self._unavailable(roles)
        if error is not None:
            raise error

    def _check_new(self, request_id: str) -> None:
        if request_id in self.generations.requests or request_id in self.chats.chats:
            raise ValueError(f"request id {request_id!r} is already running")

    async def _await(self, request_id: str, future: asyncio.Future):
        self._pump()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the caller went away (client disconnect): free everything
            await self.cancel(request_id)
            if not future.cancelled():
                future.exception()  # retrieved: nobody else will
            raise

    # ---- events -------------------------------------------------------------------------------
    def _on_message(self, identity: bytes, msg: P.WorkerMessage) -> None:
        if isinstance(msg, P.Register):
            if self.registry.register(identity, msg):
                self._pump()
            return
        if isinstance(msg, P.Heartbeat):
            self.counters.heartbeats += 1
        inst = self.registry.seen(identity, msg)
        if inst is not None and isinstance(msg, P.StatsReport):
            self._cancel_orphans(inst, msg.jobs)
        if inst is None or isinstance(msg, P.Heartbeat | P.StatsReport):
            return
        if isinstance(msg, P.TickReport):
            self.generations.on_tick(msg)
        elif self.chats.owns(msg):
            self.chats.handle(msg)
        else:
            self.generations.handle(msg)
        self._pump()

    def _cancel_orphans(self, inst: Instance, jobs) -> None:
        """Cancel each job a worker reports holding whose request (at that generation) the head does
        not hold on it: a Cancel lost while the worker was unreachable, work of a request that ended
        meanwhile. What the head charged it is left alone; a job that finished since its report was
        sent gets a Cancel the worker ignores."""
        for rid, generation in jobs:
            tracked = self.generations.requests.get(rid) or self.chats.chats.get(rid)
            if rid in inst.held and tracked is not None and tracked.machine.generation == generation:
                continue
            self.counters.orphans_cancelled += 1
            logger.info("%s holds %s g%d, which the head does not: cancelling it", inst.instance_id, rid, generation)
            self.control.send(
                inst.instance_id,
                P.Cancel(request_id=rid, generation=generation, reason="the head no longer holds this request"),
            )

    async def _tick_loop(self) -> None:
        every = min(0.1, self.config.heartbeat_interval_s / 2)
        while True:
            before = time.monotonic()
            await asyncio.sleep(every)
            now = time.monotonic()
            self._excuse_stall(now - before - every)
            for inst in self.registry.silent(now, self.config.heartbeat_timeout_s):
                self.instance_dead(inst.instance_id, f"silent for {now - inst.last_seen:.1f}s")
            self.generations.expire(now)
            self.chats.expire(now)
            if self.generations.wait_encode:
                error = self._unavailable(ROLES)
                if error is not None:
                    self.generations.fail_queued(error)
            self._pump()

    def _excuse_stall(self, late_s: float) -> None:
        """This tick ran ``late_s`` late: the head's own event loop was held (by work that should not
        run there, or the machine starved the process). Heartbeats sent meanwhile are still unread in
        the socket, so that time is not the workers' silence: it is added to each one's last sight."""
        if late_s <= self.config.heartbeat_interval_s:
            return
        self.counters.head_stalls += 1
        logger.warning("the head's event loop was held for %.1fs; not counted as worker silence", late_s)
        for inst in self.registry.instances.values():
            inst.last_seen += late_s

    def _pump(self) -> None:
        """Start whatever the free slots allow: generations first, then chats."""
        self.generations.pump()
        self.chats.pump()

    def instance_dead(self, instance_id: str, why: str) -> None:
        """Take ``instance_id`` out of service: peers reclaim its slots, its requests are retried."""
        inst = self.registry.remove(instance_id)
        if inst is None:
            return
        self.counters.instances_lost += 1
        logger.warning("%s %s declared dead (%s); %d requests affected", inst.role, instance_id, why, len(inst.held))
        for other in list(self.registry.instances):
            self.control.send(other, P.PeerDown(instance_id=instance_id))
        what = f"{inst.role} {instance_id} died ({why})"
        self.generations.instance_lost(instance_id, what)
        self.chats.instance_lost(instance_id, what)
        self._pump()
