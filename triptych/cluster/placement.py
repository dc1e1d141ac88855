"""Ray scheduling options of a worker actor, from its role's ``RoleResources`` (no Ray import).

One worker = one actor asking for its role's resources. A multi-rank denoiser (``--cfg-parallel``,
``--ulysses``, ``--ring``) is one instance of N ranks: one placement group of N equal bundles,
STRICT_PACK (all on one node: the ranks rendezvous over loopback); rank 0's actor takes bundle 0 and
spawns the follower ranks itself (as a local denoiser does), in the resources bundles 1..N-1 hold.

Worked example: ``--ulysses 2 --denoiser-cpus 2 --denoiser-resource gpu_box=1`` → a group of two
bundles ``{"CPU": 2, "gpu_box": 1}`` on one node; the actor asks for ``num_cpus=2,
resources={"gpu_box": 1}`` inside bundle 0.
"""

from __future__ import annotations

from triptych.cluster.config import RoleResources


def bundle(res: RoleResources) -> dict[str, float]:
    """One rank's resources as a placement-group bundle (zero amounts left out; never empty)."""
    out = {"CPU": res.cpus, "GPU": res.gpus, "memory": float(res.memory_mb << 20), **res.custom}
    out = {k: v for k, v in out.items() if v > 0}
    return out or {"CPU": 0.01}


def bundles(res: RoleResources, ranks: int) -> list[dict[str, float]]:
    """The bundles of one instance of ``ranks`` ranks (one per rank)."""
    return [bundle(res) for _ in range(ranks)]


def actor_options(res: RoleResources, max_restarts: int) -> dict:
    """``ActorClass.options(...)`` keywords for one worker of ``res``."""
    opts: dict = {"num_cpus": res.cpus, "num_gpus": res.gpus, "max_restarts": max_restarts, "max_task_retries": 0}
    if res.memory_mb:
        opts["memory"] = res.memory_mb << 20
    if res.custom:
        opts["resources"] = res.custom
    return opts


def group_strategy(ranks: int) -> str | None:
    """The placement-group strategy of an instance of ``ranks`` ranks; None: no group needed."""
    return "STRICT_PACK" if ranks > 1 else None


def cpus_needed(res: RoleResources, instances: int, ranks: int = 1) -> float:
    """Logical CPUs ``instances`` workers of ``res`` reserve (a Ray instance started here gets at
    least the topology's largest total)."""
    return res.cpus * instances * ranks
