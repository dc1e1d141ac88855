"""Ray scheduling options of a worker actor, from its role's ``RoleResources`` (no Ray import).

One worker = one actor asking for its role's resources. A multi-rank denoiser (``--cfg-parallel``,
``--ulysses``, ``--ring``) is one instance of N ranks: rank 0's actor spawns the follower ranks
itself (as a local denoiser does), and they rendezvous over loopback, so the instance is one
placement group, STRICT_PACK, of **one bundle holding all N ranks' resources**, and rank 0's actor
asks for the whole bundle.

Why one bundle and not one per rank: Ray hands an actor only the GPUs of the bundle it runs in (it
sets ``CUDA_VISIBLE_DEVICES`` to them), and the followers are rank 0's child processes, which
inherit its environment. With a bundle per rank, every rank would see bundle 0's single GPU;
with the whole instance in one bundle they see all N and rank r takes visible device r
(``parallel.groups.init_rank``). Tested on a simulated node with 2 GPUs
(``tests/distributed/test_ray_cluster.py``).

Worked example: ``--ulysses 2 --denoiser-cpus 2 --denoiser-gpus 1 --denoiser-resource gpu_box=1`` →
a group of one bundle ``{"CPU": 4, "GPU": 2, "gpu_box": 2}`` on one node; the actor asks for
``num_cpus=4, num_gpus=2, resources={"gpu_box": 2}`` in it.
"""

from __future__ import annotations

from triptych.deploy.config import RoleResources


def bundle(res: RoleResources, ranks: int = 1) -> dict[str, float]:
    """The resources of one instance of ``ranks`` ranks as one placement-group bundle (zero amounts
    left out; never empty)."""
    out = {"CPU": res.cpus, "GPU": res.gpus, "memory": float(res.memory_mb << 20), **res.custom}
    out = {k: v * ranks for k, v in out.items() if v > 0}
    return out or {"CPU": 0.01}


def bundles(res: RoleResources, ranks: int) -> list[dict[str, float]]:
    """The placement group of one instance of ``ranks`` ranks: a single bundle with all of them."""
    return [bundle(res, ranks)]


def actor_options(res: RoleResources, max_restarts: int, ranks: int = 1) -> dict:
    """``ActorClass.options(...)`` keywords for one worker of ``res`` (rank 0 of ``ranks``: it holds
    the resources of every rank it spawns)."""
    opts: dict = {
        "num_cpus": res.cpus * ranks,
        "num_gpus": res.gpus * ranks,
        "max_restarts": max_restarts,
        "max_task_retries": 0,
    }
    if res.memory_mb:
        opts["memory"] = (res.memory_mb << 20) * ranks
    if res.custom:
        opts["resources"] = {k: v * ranks for k, v in res.custom.items()}
    return opts


def group_strategy(ranks: int) -> str | None:
    """The placement-group strategy of an instance of ``ranks`` ranks; None: no group needed."""
    return "STRICT_PACK" if ranks > 1 else None


def cpus_needed(res: RoleResources, instances: int, ranks: int = 1) -> float:
    """Logical CPUs ``instances`` workers of ``res`` reserve (a Ray instance started here gets at
    least the topology's largest total)."""
    return res.cpus * instances * ranks
