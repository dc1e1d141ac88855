"""Autoscaling a head's pools: a pure policy and the loop that applies it.

``decide`` is the whole policy: from a pool's queue depth, its oldest wait, its instance count and
how long it has had an idle instance, it answers +1 (add one), 0 or -1 (drain one).

``Autoscaler`` owns scale-in. Contract: it drains an instance first (``Orchestrator.drain``: no new
request is routed there), waits until the instance holds no request, then tells the pool not to
restart it (``WorkerPool.retire``) and the instance to shut down; the pool reports its exit to the
head as any exit is. So no request is dropped. It never adds while an added instance is still
starting, nor drains while another one of the role drains. Everything runs on the head's loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from triptych.core.kinds import Role
from triptych.deploy.config import AutoscaleConfig

logger = logging.getLogger(__name__)


def decide(
    queue_depth: int, oldest_wait_s: float, instances: int, idle_s: float, lo: int, hi: int, config: AutoscaleConfig
) -> int:
    """+1, 0 or -1 instances for a pool of ``instances`` kept within [``lo``, ``hi``].

    Grow when ``queue_depth`` requests wait for the role (at least ``config.up_queue``) or the
    oldest has waited ``config.up_wait_s``; shrink when nothing waits and an instance has been idle
    for ``config.down_idle_s`` (``idle_s``).
    """
    if instances < lo:
        return 1
    if instances > hi:
        return -1
    busy = queue_depth >= config.up_queue or (queue_depth > 0 and oldest_wait_s >= config.up_wait_s)
    if busy and instances < hi:
        return 1
    if queue_depth == 0 and idle_s >= config.down_idle_s and instances > lo:
        return -1
    return 0


@dataclass(frozen=True)
class Sample:
    """One look at one pool (the autoscaler's timeline, for /health and benchmarks)."""

    t: float  # monotonic seconds
    role: Role
    instances: int  # live + starting (what the policy counted)
    queue_depth: int
    oldest_wait_s: float
    action: int  # what it did: +1, 0, -1


class Autoscaler:
    """Applies ``decide`` to each pool of ``config.bounds()`` every ``config.interval_s`` (see the
    module docstring for the drain contract). ``orchestrator`` gives ``load``, ``drain``, ``stop``
    and ``instances``; ``pool`` is a ``supervisor.WorkerPool``."""

    def __init__(self, orchestrator, pool, head: str, config: AutoscaleConfig, keep_samples: int = 20000):
        self.orchestrator = orchestrator
        self.pool = pool
        self.head = head
        self.config = config
        self.bounds = config.bounds()
        self.samples: list[Sample] = []
        self.keep_samples = keep_samples
        self.events: list[tuple[float, str, str, str]] = []  # (t, role, "add"|"drain"|"stop", instance id)
        self._idle_since: dict[str, float] = {}
        self._stopping: set[str] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            self.step(time.monotonic())

    def step(self, now: float) -> dict[str, int]:
        """One look at every autoscaled pool; returns role → the action taken."""
        return {role: self._step_role(role, lo, hi, now) for role, (lo, hi) in self.bounds.items()}

    def _step_role(self, role: Role, lo: int, hi: int, now: float) -> int:
        load = self.orchestrator.load(role, now)
        for iid, held in load.draining.items():
            if held == 0 and iid not in self._stopping:
                self._stopping.add(iid)
                self.pool.retire(iid)
                self.orchestrator.stop(iid, "scaled in")
                self.events.append((now, role, "stop", iid))
        registered = self.orchestrator.instances
        starting = [i for i in self.pool.current(role) if i not in registered and i not in self._stopping]
        instances = len(load.live) + len(starting)
        if load.queue_depth == 0 and load.idle and not starting:
            self._idle_since.setdefault(role, now)
        else:
            self._idle_since.pop(role, None)
        idle_s = now - self._idle_since.get(role, now)
        action = decide(load.queue_depth, load.oldest_wait_s, instances, idle_s, lo, hi, self.config)
        if action > 0 and starting:
            action = 0  # one at a time: the last one added has not registered yet
        if action < 0 and (load.draining or not load.live):
            action = 0  # one at a time: another one still drains
        if action > 0:
            iid = self.pool.spawn(role, self.head)
            self.events.append((now, role, "add", iid))
            logger.info("autoscale: %s pool %d -> %d (%s)", role, instances, instances + 1, iid)
        elif action < 0:
            victim = max(load.idle or load.live)  # the newest idle one (ids count up)
            self.orchestrator.drain(victim)
            self._idle_since.pop(role, None)
            self.events.append((now, role, "drain", victim))
            logger.info("autoscale: %s pool %d -> %d (draining %s)", role, instances, instances - 1, victim)
        self.samples.append(Sample(now, role, instances, load.queue_depth, load.oldest_wait_s, action))
        del self.samples[: -self.keep_samples]
        return action

    def describe(self) -> dict:
        last = {s.role: s for s in self.samples[-len(self.bounds) :]} if self.samples else {}
        return {
            "bounds": {r: list(b) for r, b in self.bounds.items()},
            "instances": {r: s.instances for r, s in last.items()},
            "events": len(self.events),
        }
