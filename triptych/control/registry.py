"""The head's instance registry: who is registered, alive, and how loaded.

``InstanceRegistry`` admits a ``Register`` (same model revision, a new instance id), keeps each
instance's last heartbeat and stats report (the report windows go to ``metrics``), declares an
instance dead when it was silent past the heartbeat timeout, and asks an unknown live instance to
rejoin. It owns the ``Instance`` records and the dispatch policies; request routing reads pools
from it and charges slots on its instances. Death handling beyond the registry (retries, telling
peers) is the orchestrator's.
"""

from __future__ import annotations

import logging
import time

import msgspec
from cachetools import FIFOCache

from triptych.control import protocol as P
from triptych.control.affinity import ImageAffinity
from triptych.control.counters import RegistryCounters
from triptych.control.dispatch import DispatchPolicy, Instance, make_policy
from triptych.control.listener import ControlPlane
from triptych.control.metrics import Metrics
from triptych.control.worker_stats import stats_window
from triptych.core.errors import shown
from triptych.core.kinds import ROLES, Role

logger = logging.getLogger(__name__)


class InstanceRegistry:
    def __init__(
        self,
        revision: str,
        dispatch: str,
        heartbeat_interval_s: float,
        control: ControlPlane,
        metrics: Metrics,
        counters: RegistryCounters,
    ):
        self.revision = revision
        self.heartbeat_interval_s = heartbeat_interval_s
        self.control = control
        self.metrics = metrics
        self.counters = counters
        self.instances: dict[str, Instance] = {}
        self.policies: dict[str, DispatchPolicy] = {r: make_policy(dispatch) for r in ROLES}
        self.affinity = ImageAffinity()  # which encoder holds which tenant's images (``affinity``)
        #: unknown instance id -> when it was last told to rejoin; dead instance -> (pid, last report).
        #: Ids of gone instances: the oldest written are forgotten past 1024.
        self._rejoin_sent: FIFOCache[str, float] = FIFOCache(1024)
        self._last_stats: FIFOCache[str, tuple[int, P.StatsReport]] = FIFOCache(1024)
        now = time.monotonic()
        self._empty_since: dict[str, float] = {role: now for role in self.policies}  # role -> pool empty since

    def pool(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role]

    def addresses(self, role: Role) -> dict[str, str]:
        """Instance id → transfer endpoint address, for the role's registered instances."""
        return {i.instance_id: i.data for i in self.pool(role)}

    def register(self, identity: bytes, m: P.Register) -> bool:
        """Admit or refuse ``m``; answers the worker with ``RegisterAck`` either way."""
        reason = None
        if m.revision != self.revision:
            reason = f"model revision {m.revision} != head's {self.revision}: start the worker with the head's --model"
        elif m.instance_id in self.instances:
            reason = f"instance id {m.instance_id!r} is already registered"
        if reason is None:
            self.control.bind(m.instance_id, identity, m.channels)
            self._rejoin_sent.pop(m.instance_id, None)
            inst = Instance(
                m.instance_id,
                m.role,
                m.capacity,
                m.control,
                m.data,
                m.transfer,
                m.pid,
                time.monotonic(),
                chat=m.chat,
                chat_slots=m.chat_slots,
            )
            last = self._last_stats.pop(m.instance_id, None)
            if last is not None and last[0] == m.pid:  # the same process rejoining: its counters continue
                inst.stats = last[1]
            self.instances[m.instance_id] = inst
            self._empty_since.pop(m.role, None)
            logger.info(
                "registered %s %s (capacity %d, %s at %s)", m.role, m.instance_id, m.capacity, m.transfer, m.data
            )
        else:
            logger.warning("refused %s: %s", shown(m.instance_id), reason)
        ack = P.RegisterAck(
            instance_id=m.instance_id,
            accepted=reason is None,
            reason=reason,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        self.control.send_to(identity, ack)
        return reason is None

    def seen(self, identity: bytes, msg: P.WorkerMessage) -> Instance | None:
        """The registered sender of ``msg`` (its liveness refreshed), or None after asking it to rejoin.
        Heartbeats and stats reports are consumed here."""
        inst = self.instances.get(msg.instance_id)
        if inst is None:
            self.counters.from_unknown_instance += 1
            logger.debug("message from unknown instance %s dropped", shown(msg.instance_id))
            if not isinstance(msg, P.Heartbeat):  # the heartbeat socket never reads: answer the control one
                self._tell_rejoin(identity, msg.instance_id)
            return None
        inst.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat):
            inst.report = msgspec.structs.asdict(msg)
            del inst.report["instance_id"]
        elif isinstance(msg, P.StatsReport):
            self.metrics.record_worker_window(stats_window(inst.role, inst.stats, msg))
            inst.stats = msg
        return inst

    def missing(self, now: float, grace_s: float) -> dict[str, float]:
        """Roles with no live instance for longer than ``grace_s`` → for how long."""
        return {role: now - t for role, t in self._empty_since.items() if now - t > grace_s}

    def expect(self, role: Role) -> None:
        """A worker of ``role`` is starting (spawned or restarted here): its absence restarts its grace."""
        if role in self._empty_since:
            self._empty_since[role] = time.monotonic()

    def empty_roles(self) -> list[str]:
        return sorted(self._empty_since)

    def silent(self, now: float, timeout_s: float) -> list[Instance]:
        return [i for i in self.instances.values() if now - i.last_seen > timeout_s]

    def remove(self, instance_id: str) -> Instance | None:
        """Forget a dead instance; its last stats are kept in case the same process rejoins."""
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return None
        if not self.pool(inst.role):
            self._empty_since[inst.role] = time.monotonic()
        self.metrics.forget_instance(instance_id)
        self.affinity.forget(instance_id)
        self.control.forget(instance_id)
        if inst.stats is not None:
            self._last_stats[instance_id] = (inst.pid, inst.stats)
        return inst

    def _tell_rejoin(self, identity: bytes, instance_id: str) -> None:
        """An instance we do not know is alive (declared dead while only silent, e.g. a stalled
        process or a partition): tell it to drop its jobs and register again, once per interval."""
        now = time.monotonic()
        if now - self._rejoin_sent.get(instance_id, -1e9) < self.heartbeat_interval_s:
            return
        self._rejoin_sent[instance_id] = now
        self.counters.rejoins_requested += 1
        logger.warning(
            "%s is alive but not registered (declared dead earlier?); asking it to rejoin", shown(instance_id)
        )
        self.control.send_to(identity, P.Rejoin(reason="not registered with this head"))

    def describe(self) -> list[dict]:
        return [
            {
                "id": i.instance_id,
                "role": i.role,
                "state": "draining" if i.draining else "busy" if i.held else "idle",
                "capacity": i.capacity,
                "free": i.free,
                "chat_slots": i.chat_slots,
                "chat_free": i.chat_free if i.chat else 0,
                "held": sorted(i.held),
                "assigned": i.assigned,
                "transfer": i.transfer,
                "pid": i.pid,
                "loras": i.loras,
                "report": dict(i.report),
            }
            for i in sorted(self.instances.values(), key=lambda i: i.instance_id)
        ]
