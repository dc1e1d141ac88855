"""A simulated cluster under the head's real scheduling code.

The head here is the real one minus its sockets: ``head.admission.Admission`` (the in-flight
bound), ``control.deadlines.check`` (refusal at once), a ``control.routing.GenerationRouter``
(its lifecycle's fair queue, placement with the dispatch policies, slot backpressure, expiry,
step costs learned from ``DenoiseDone``) on the virtual clock, and, with ``ClusterConfig.autoscale``,
a ``deploy.autoscale.Autoscaler`` stepping on ``orchestrator.pool_load``. Workers are
``sim.workers``. Messages from a worker reach the head at the same virtual instant, after what was
already scheduled for it; the head pumps (places queued work) once per instant that had a message,
an admission or an expiry tick (every ``expire_every_s``, as the head's tick loop).

A request ends with an HTTP status as the head would answer: 200 (done; its latency includes the
cost model's per-request overhead), 429 (``Overloaded``: the deadline check, the in-flight bound or
the router's queue), 504 (its deadline passed while it waited), 500 (failed or timed out otherwise).
Chats bypass the router: each takes ``chat_s`` in the queue of the encoder with the fewest queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from triptych.control import deadlines
from triptych.control.backend import DeadlineMissed, GenerationJob, Overloaded
from triptych.control.counters import LifecycleCounters, RegistryCounters
from triptych.control.dispatch import Instance
from triptych.control.orchestrator import OrchestratorConfig, generation_router, pool_load
from triptych.control.registry import InstanceRegistry
from triptych.core.kinds import Role
from triptych.deploy.autoscale import Autoscaler
from triptych.deploy.config import AutoscaleConfig
from triptych.engine.config import EngineConfig
from triptych.head.admission import Admission, AdmissionLimits
from triptych.sim.costs import CostModel
from triptych.sim.loop import EventLoop
from triptych.sim.workers import SimDenoiser, SimStage


@dataclass(frozen=True)
class SimParams:
    """What the head and the workers read of a resolved ``GenerationParams``."""

    height: int
    width: int
    steps: int
    priority: int = 0
    tenant: str = ""
    frames: int | None = None
    image: object = None
    lora: tuple = ()


@dataclass(frozen=True)
class ClusterConfig:
    encoders: int = 1
    denoisers: int = 1
    decoders: int = 1
    capacity: int = 16  # slots per worker (``serve --capacity``)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(lower_class_places=0))
    max_queued_requests: int = 64  # the head's in-flight bound (``AdmissionLimits``)
    max_queued: int = OrchestratorConfig.max_queued  # the router's queue bound (``OrchestratorConfig``)
    dispatch: str = "round_robin"
    autoscale: AutoscaleConfig | None = None  # its pools grow from the counts above
    startup_s: float = 20.0  # an added worker's start, spawn to registered
    expire_every_s: float = 0.1
    learn_costs: bool = True  # the head starts knowing every measured tick (as after a warm-up)


class _Quiet:
    """The registry's and router's metrics and control plane: nothing to report to."""

    def record_stage(self, stats) -> None:
        pass

    def forget_instance(self, instance_id: str) -> None:
        pass

    def forget(self, instance_id: str) -> None:
        pass


class _NoChats:
    def backlog(self, now: float) -> tuple[int, float]:
        return 0, 0.0


Done = Callable[[str, int, float], None]  # (request id, HTTP status, end time)


class SimCluster:
    def __init__(self, costs: CostModel, config: ClusterConfig, loop: EventLoop | None = None):
        self.costs, self.config = costs, config
        self.loop = loop or EventLoop()
        oc = dataclasses.replace(OrchestratorConfig(), max_queued=config.max_queued)
        quiet = _Quiet()
        self.registry = InstanceRegistry(
            "sim", config.dispatch, oc.heartbeat_interval_s, quiet, quiet, RegistryCounters()
        )
        self.counters = LifecycleCounters()
        self.router = generation_router(oc, self.registry, self._to_worker, quiet, self.counters, self.loop.clock)
        if config.learn_costs:
            for (h, w), table in costs.tick_s.items():
                for n, seconds in table.items():
                    self.router.costs.learn((h, w, None), seconds, n)
        self.admission = Admission(AdmissionLimits(max_queued_requests=config.max_queued_requests))
        self.workers: dict[str, SimStage | SimDenoiser] = {}
        self.retired: list[SimDenoiser | SimStage] = []  # stopped workers (their counters)
        self._ids: dict[str, int] = {}
        self._live: dict[str, tuple[asyncio.Future, Done]] = {}
        self._pump_pending = False
        for role, n in (
            (Role.ENCODER, config.encoders),
            (Role.DENOISER, config.denoisers),
            (Role.DECODER, config.decoders),
        ):
            for _ in range(n):
                self._register(self._new_id(role), role)
        self.autoscaler = None
        if config.autoscale is not None:
            self.autoscaler = Autoscaler(_Orchestrator(self), _Pool(self), "sim", config.autoscale)
            self.loop.after(config.autoscale.interval_s, self._autoscale)
        self.loop.after(config.expire_every_s, self._expire)

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, rid: str, params: SimParams, deadline_s: float | None, done: Done) -> None:
        """A generation arriving now: checked and admitted as the head's route does, or ended at once."""
        now = self.loop.now
        at = None if deadline_s is None else now + deadline_s
        job = GenerationJob(rid, params, "png", deadline_s=deadline_s, deadline_at=at)
        try:
            deadlines.check(self.router, [job], now)
            self.admission.reserve(1)
        except Overloaded:
            return done(rid, 429, now)
        try:
            future = self.router.submit(job, None, wire_params=params)
        except Overloaded:
            self.admission.release(1)
            return done(rid, 429, now)
        self._live[rid] = (future, done)
        self._pump_soon()

    def chat(self, priority: int, done: Callable[[], None]) -> None:
        encoders = [w for w in self.workers.values() if isinstance(w, SimStage) and w.kind == Role.ENCODER]
        min(encoders, key=lambda w: w.queued).chat(priority, done)

    def _settle(self, rid: str) -> None:
        entry = self._live.get(rid)
        if entry is None or not entry[0].done():
            return
        future, done = self._live.pop(rid)
        self.admission.release(1)
        error = future.exception()
        status = 200 if error is None else 504 if isinstance(error, DeadlineMissed) else 500
        done(rid, status, self.loop.now)

    # ---- messages -----------------------------------------------------------------------------
    def _to_worker(self, instance_id: str, msg) -> None:
        worker = self.workers.get(instance_id)
        if worker is not None:
            worker.receive(msg)

    def _from_worker(self, msg) -> None:
        self.loop.after(0.0, lambda: self._deliver(msg))

    def _deliver(self, msg) -> None:
        self.router.handle(msg)
        self._settle(msg.request_id)
        self._pump_soon()

    def _pump_soon(self) -> None:
        if not self._pump_pending:
            self._pump_pending = True
            self.loop.after(0.0, self._pump)

    def _pump(self) -> None:
        self._pump_pending = False
        self.router.pump()

    def _expire(self) -> None:
        self.router.expire(self.loop.now)
        for rid in [rid for rid, (f, _) in self._live.items() if f.done()]:
            self._settle(rid)
        self._pump()
        self.loop.after(self.config.expire_every_s, self._expire)

    def _autoscale(self) -> None:
        self.autoscaler.step(self.loop.now)
        self.loop.after(self.config.autoscale.interval_s, self._autoscale)

    # ---- instances ----------------------------------------------------------------------------
    def _new_id(self, role: Role) -> str:
        n = self._ids.get(role, 0)
        self._ids[role] = n + 1
        return f"{role}-{n:04d}"  # ids count up in string order too (the autoscaler drains the newest)

    def _register(self, iid: str, role: Role) -> None:
        c = self.config
        if role == Role.DENOISER:
            self.workers[iid] = SimDenoiser(iid, self.loop, self.costs, c.engine, self._from_worker)
        else:
            self.workers[iid] = SimStage(iid, role, self.loop, self.costs, self._from_worker)
        self.registry.instances[iid] = Instance(iid, role, c.capacity, iid, iid, "sim", 0, self.loop.now)
        self._pump_soon()

    def _unregister(self, iid: str) -> None:
        self.registry.remove(iid)
        worker = self.workers.pop(iid, None)
        if worker is not None:
            self.retired.append(worker)

    def denoisers(self) -> list[SimDenoiser]:
        return [w for w in self.workers.values() if isinstance(w, SimDenoiser)] + [
            w for w in self.retired if isinstance(w, SimDenoiser)
        ]


class _Orchestrator:
    """What the ``Autoscaler`` reads and calls of the head."""

    def __init__(self, cluster: SimCluster):
        self.cluster = cluster

    @property
    def instances(self) -> dict[str, Instance]:
        return self.cluster.registry.instances

    def load(self, role: Role, now: float):
        return pool_load(self.cluster.registry.pool(role), self.cluster.router, _NoChats(), role, now)

    def drain(self, instance_id: str) -> bool:
        inst = self.cluster.registry.instances.get(instance_id)
        if inst is None:
            return False
        inst.draining = True
        return True

    def stop(self, instance_id: str, reason: str) -> None:
        self.cluster._unregister(instance_id)


class _Pool:
    """What the ``Autoscaler`` calls of a ``WorkerPool``: workers start ``startup_s`` after spawn."""

    def __init__(self, cluster: SimCluster):
        self.cluster = cluster
        self._starting: dict[str, Role] = {}
        self._retired: set[str] = set()

    def current(self, role: Role) -> list[str]:
        live = [i.instance_id for i in self.cluster.registry.pool(role)]
        return live + [iid for iid, r in self._starting.items() if r == role]

    def spawn(self, role: Role, head: str) -> str:
        iid = self.cluster._new_id(role)
        self._starting[iid] = role

        def registered() -> None:
            self._starting.pop(iid, None)
            self.cluster._register(iid, role)

        self.cluster.loop.after(self.cluster.config.startup_s, registered)
        return iid

    def retire(self, instance_id: str) -> None:
        self._retired.add(instance_id)
