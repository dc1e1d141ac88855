"""``RayWorkers``: a ``supervisor.WorkerPool`` whose workers are Ray actors.

Each worker is one ``WorkerActor`` that runs the very ``triptych worker`` command a local supervisor
runs (``supervisor.worker_command``) as a subprocess it owns, on the node Ray chose. Why a
subprocess rather than the worker loop inside the actor: the worker keeps its own process (its
signal handling, torch threads, the pid it registers with, the follower ranks a multi-rank
denoiser spawns) exactly as under the local supervisor, and the actor stays a small supervisor
Ray can restart. The two live and die together: the worker is started with ``--exit-with-parent``
(the actor's pid), and the actor exits (code 1, so Ray restarts it, up to ``max_restarts``) when
its worker exits, unless it was retired.

A restarted actor registers under a new instance id (``<id>.<6 hex>``): the head treats it as a new
instance, and the one it replaces is declared dead as soon as the watch loop sees the actor died
or came back (requests it held are retried), or by heartbeat silence at the latest.

Loopback: with ``ClusterConfig.ray_node_ip`` a loopback address, every Ray listener this driver
starts or dials stays on 127.0.0.1 (see ``init_ray``). The deployment token reaches the actors as a
constructor argument, so it is stored in Ray's GCS: keep the Ray cluster private.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from triptych.core.kinds import ROLES, Role
from triptych.deploy.config import AutoscaleConfig, ClusterConfig
from triptych.deploy.placement import actor_options, bundles, cpus_needed, group_strategy
from triptych.deploy.supervisor import worker_command, worker_config

logger = logging.getLogger(__name__)

#: NOTE: read by ``ray._private.services`` when Ray turns a loopback address into the machine's
#: outward one (``resolve_ip_for_localhost``); off, 127.0.0.1 stays 127.0.0.1 for the driver, and
#: the processes a Ray instance started from here inherit it.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_pool(
    cluster: ClusterConfig, topology, autoscale: AutoscaleConfig, copies: int = 1
) -> tuple[Callable[..., RayWorkers], Callable[[], None]]:
    """Start or join Ray for ``triptych serve``: the ``WorkerPool`` factory each model's
    ``EmbeddedBackend`` calls, and the function that shuts Ray down again when it was started or
    joined here (a no-op otherwise; the caller runs it once every backend is closed). A Ray instance
    started here gets the logical CPUs and custom resources of ``copies`` topologies (one per served
    model) at their largest (autoscaled pools at their MAX)."""
    counts = {role: topology.count(role) for role in ROLES}
    for role, (_, hi) in autoscale.bounds().items():
        counts[role] = max(counts[role], hi)
    cpus, custom = 0.0, {}
    for role, n in counts.items():
        res, ranks = cluster.resources(role), topology.ranks(role)
        cpus += cpus_needed(res, n, ranks)
        for name, amount in res.custom.items():
            custom[name] = custom.get(name, 0.0) + amount * n * ranks
    custom = {name: amount * copies for name, amount in custom.items()}
    owns = init_ray(cluster, cluster.ray_num_cpus or cpus * copies, custom)

    def stop() -> None:
        if owns:
            import ray

            ray.shutdown()

    return functools.partial(RayWorkers, cluster), stop


def init_ray(config: ClusterConfig, num_cpus: float, resources: dict[str, float] | None = None) -> bool:
    """Connect this process to Ray (``config.ray_address``), or start a local Ray instance with
    ``num_cpus`` logical CPUs and ``resources``, no dashboard and no log forwarding. Returns True
    when it started or joined here (the caller shuts it down), False when Ray was already
    initialized."""
    if config.loopback:
        os.environ[LOOPBACK_SWITCH] = "0"
    import ray
    from ray._private import ray_constants

    if config.loopback:
        ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the line above
    if ray.is_initialized():
        return False
    kwargs: dict = {"_node_ip_address": config.ray_node_ip, "log_to_driver": False, "configure_logging": False}
    if config.ray_address:
        ray.init(address=config.ray_address, **kwargs)
    else:
        ray.init(
            num_cpus=max(1, math.ceil(num_cpus)),
            resources=resources or None,
            include_dashboard=False,
            object_store_memory=80 << 20,
            **kwargs,
        )
    return True


class WorkerActor:
    """Runs one worker process (see the module docstring). Methods run on the actor's thread; the
    watch thread only exits the process."""

    def __init__(self, cmd: list[str], env: dict[str, str], instance_id: str):
        import ray

        ctx = ray.get_runtime_context()
        if ctx.was_current_actor_reconstructed:
            instance_id = f"{instance_id}.{uuid.uuid4().hex[:6]}"  # a new instance to the head
        self.instance_id = instance_id
        self.node_id = ctx.get_node_id()
        argv = [*cmd, "--instance-id", instance_id, "--host", ray.util.get_node_ip_address()]
        argv += ["--exit-with-parent", str(os.getpid())]
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        self.retired = False
        threading.Thread(target=self._watch, name="worker-watch", daemon=True).start()

    def _watch(self) -> None:
        self.proc.wait()
        if not self.retired:
            os._exit(1)  # a crash to Ray: it restarts the actor within max_restarts

    def info(self) -> dict:
        return {
            "instance_id": self.instance_id,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "worker_pid": self.proc.pid,
            "exit_code": self.proc.poll(),
        }

    def retire(self) -> None:
        """Its worker's exit is expected from now on: the actor stays up until killed."""
        self.retired = True


@dataclass
class _Actor:
    role: Role
    base_id: str  # the id of its first incarnation
    instance_id: str  # the current incarnation's
    actor: object
    group: object | None  # its placement group (multi-rank denoiser)
    info: dict = field(default_factory=dict)
    restarts: int = 0
    reported: bool = False  # its current incarnation's end was reported to the head
    retired: bool = False
    given_up: bool = False


class RayWorkers:
    """``WorkerPool`` of Ray actors (module docstring). Ray itself is started and stopped by whoever
    joined it (``ray_pool``'s stop function), not by a pool: several models' pools share it."""

    def __init__(
        self,
        cluster: ClusterConfig,
        model_dir: Path,
        topology,
        token: str,
        on_exit: Callable[[str, int], None],
        on_start: Callable[[str], None] = lambda role: None,
    ):
        import ray

        self.ray = ray
        self.cluster = cluster
        self.model_dir = model_dir
        self.topology = topology
        self.token = token
        self.on_exit = on_exit
        self.on_start = on_start
        self.actors: dict[str, _Actor] = {}  # base id -> actor
        self.restarts_total = 0
        self._remote = ray.remote(WorkerActor)
        self._task: asyncio.Task | None = None

    def spawn(self, role: Role, head: str, instance_id: str | None = None) -> str:
        n = 0
        while f"{role}-{n}" in self.actors:
            n += 1
        iid = instance_id or f"{role}-{n}"
        res = self.cluster.resources(role)
        ranks = self.topology.ranks(role)
        threads = self.topology.threads(role) or max(1, int(res.cpus))
        config = worker_config(self.topology, self.model_dir, role, head, iid, threads, self.token)
        cmd = worker_command(config, self.topology.extra_args)
        options = actor_options(res, self.cluster.ray_max_restarts, ranks)
        group = None
        if (strategy := group_strategy(ranks)) is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = self.ray.util.placement_group(bundles(res, ranks), strategy=strategy)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        env = {"HF_HUB_OFFLINE": "1", "TRIPTYCH_TOKEN": self.token}
        actor = self._remote.options(name=None, **options).remote(cmd, env, iid)
        self.actors[iid] = _Actor(role, iid, iid, actor, group)
        self.on_start(role)
        logger.info("placed %s as a Ray actor (%s)", iid, options)
        return iid

    def _find(self, instance_id: str) -> _Actor:
        for a in self.actors.values():
            if instance_id in (a.base_id, a.instance_id):
                return a
        raise KeyError(instance_id)

    def current(self, role: Role) -> list[str]:
        return sorted(a.instance_id for a in self.actors.values() if a.role == role and not (a.retired or a.given_up))

    def retire(self, instance_id: str) -> None:
        a = self._find(instance_id)
        self.ray.get(a.actor.retire.remote(), timeout=30)
        a.retired = True

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        """Signal the actor's process (it must run on this machine: tests, operators)."""
        os.kill(self.node_info(instance_id)["pid"], sig)

    def node_info(self, instance_id: str, timeout_s: float = 60.0) -> dict:
        """The actor's ``info()`` now: instance id, node id, actor pid, worker pid, exit code."""
        return self.ray.get(self._find(instance_id).actor.info.remote(), timeout=timeout_s)

    # ---- supervision ----------------------------------------------------------------------------
    def watch(self, head: str, interval_s: float = 0.25) -> None:
        self._task = asyncio.create_task(self._watch(interval_s), name="ray-workers")

    async def stop_watching(self) -> None:
        """Stop supervising: from now on no worker's exit makes Ray restart its actor."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        live = [a for a in self.actors.values() if not a.given_up]
        await asyncio.gather(*(self._call(a, "retire") for a in live), return_exceptions=True)
        for a in live:
            a.retired = True

    async def _call(self, a: _Actor, method: str, timeout_s: float = 10.0):
        return await asyncio.wait_for(getattr(a.actor, method).remote(), timeout_s)

    async def _watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            live = [a for a in self.actors.values() if not a.given_up]
            await asyncio.gather(*(self._check(a, interval_s * 8) for a in live))

    async def _check(self, a: _Actor, timeout_s: float) -> None:
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            info = await self._call(a, "info", timeout_s)
        except TimeoutError:
            return  # restarting (its calls wait for it) or slow
        except RayActorError as e:
            self._ended(a, -9, f"actor died: {type(e).__name__}")
            if isinstance(e, ActorDiedError) and a.restarts >= self.cluster.ray_max_restarts >= 0:
                logger.error("%s: Ray will not restart it again (%d restarts)", a.base_id, a.restarts)
                a.given_up = True  # out of current(): the autoscaler may replace it
                await self._release(a)
            return
        if info["instance_id"] != a.instance_id:  # Ray restarted it since the last look
            self._ended(a, -9, "actor restarted")
            a.instance_id, a.reported = info["instance_id"], False
            a.restarts += 1
            self.restarts_total += 1
            self.on_start(a.role)
        a.info = info
        if a.retired and info["exit_code"] is not None:
            self._ended(a, info["exit_code"], "retired")
            a.given_up = True
            await self._release(a)

    def _ended(self, a: _Actor, code: int, why: str) -> None:
        if not a.reported:
            a.reported = True
            logger.warning("%s (%s) ended: %s", a.instance_id, a.role, why)
            self.on_exit(a.instance_id, code)

    async def _release(self, a: _Actor, timeout_s: float = 10.0) -> None:
        """Kill the actor for good and free its placement group (off the loop: the removal waits on
        the GCS, which may wait on a node that is gone)."""
        self.ray.kill(a.actor, no_restart=True)
        group, a.group = a.group, None
        if group is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.ray.util.remove_placement_group, group), timeout_s)
            except TimeoutError:
                logger.warning("placement group of %s not removed within %.0fs", a.base_id, timeout_s)

    def describe(self) -> dict:
        return {
            "cluster": "ray",
            "restarts": self.restarts_total,
            "layout": {a.instance_id: a.info.get("node_id", "") for a in self.actors.values() if not a.given_up},
            "device": self.topology.device.device,
            "workers": {
                a.instance_id: {
                    "role": a.role,
                    "node": a.info.get("node_id", ""),
                    "pid": a.info.get("worker_pid"),
                    "actor_pid": a.info.get("pid"),
                    "running": a.info.get("exit_code", 0) is None,
                    "restarts": a.restarts,
                    "retired": a.retired,
                    "given_up": a.given_up,
                }
                for a in sorted(self.actors.values(), key=lambda a: a.base_id)
            },
        }

    async def reap(self, timeout_s: float = 15.0) -> None:
        """Wait for the workers to exit (a shutdown was sent), then kill every actor and free its group."""
        await asyncio.gather(*(self._await_exit(a, timeout_s) for a in self.actors.values() if not a.given_up))
        self.actors.clear()

    async def _await_exit(self, a: _Actor, timeout_s: float) -> None:
        from ray.exceptions import RayActorError

        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            try:
                if (await self._call(a, "info", 5.0))["exit_code"] is not None:
                    break
            except (RayActorError, TimeoutError):  # dead or unreachable: nothing left to wait for
                break
            await asyncio.sleep(0.1)
        else:
            logger.warning("worker %s did not stop in %.0fs; killing its actor", a.instance_id, timeout_s)
        await self._release(a)
