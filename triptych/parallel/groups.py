"""Process groups of one multi-rank instance, as an object handed to whoever runs a collective.

Rank arithmetic. The instance's ``world_size`` = cfg × ring × ulysses ranks form a device mesh of
shape ``(cfg, ring, ulysses)`` (dimension names ``"cfg"``, ``"ring"``, ``"ulysses"``), filled in
rank order, so

    rank = cfg_index × (ring × ulysses) + ring_index × ulysses + ulysses_index

Worked example, 4 ranks with cfg=2 × ulysses=2 (ring=1)::

    rank  cfg_index  ulysses_index   sequence group (shares a row)   cfg group (exchanges rows)
    0     0          0               {0, 1}                          {0, 2}
    1     0          1               {0, 1}                          {1, 3}
    2     1          0               {2, 3}                          {0, 2}
    3     1          1               {2, 3}                          {1, 3}

Ranks 0 and 1 compute the first half of the rows (the cond rows), each holding half of every row's
tokens; ranks 2 and 3 the second half. After the sequence gather every rank of a sequence group
holds its half's full rows; one all-gather over each cfg group ({0, 2} and {1, 3}) then gives every
rank all rows.

Lifetime: the default process group is created once per rank (``init_rank``) and destroyed by its
owner (``destroy``); a ``ParallelGroups`` creates its sub-groups from it and is valid while it lives.
Building one is a collective: every rank of the instance builds it with the same config, in the same
order as any other collective.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from triptych.core.parallel_config import ParallelConfig

logger = logging.getLogger(__name__)

MESH_DIMS = ("cfg", "ring", "ulysses")
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free when asked (bind to port 0, read it, close).

    NOTE: another process may take the port between this call and the rendezvous; callers that can
    retry a failed rendezvous with a fresh port should.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _group_config(backend: str, timeout: datetime.timedelta) -> tuple[str, object]:
    """A device-mesh backend override carrying ``timeout``.

    NOTE: torch creates a mesh's sub-groups (and diffusers' flattened ring×ulysses group) with
    torch's default 30-minute timeout, not the default group's; passing the options makes every
    sub-group fail after the instance's timeout too.
    """
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


def _default_group_timeout(device: torch.device) -> datetime.timedelta:
    backend = dist.group.WORLD._get_backend(device)
    return getattr(getattr(backend, "options", None), "_timeout", DEFAULT_TIMEOUT)


def init_rank(
    rank: int,
    world_size: int,
    port: int,
    *,
    device: str | torch.device = "cpu",
    host: str = "127.0.0.1",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.device:
    """Join the instance's default process group (TCP rendezvous at ``host:port``); returns this
    rank's device (``cuda:<rank % devices>`` for a CUDA ``device``). Every collective on the group
    and its sub-groups fails after ``timeout`` instead of waiting on a dead rank."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=default_backend(device),
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return device


def destroy() -> None:
    """Tear down this rank's default process group (and with it every sub-group)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's view of the instance: its device, mesh coordinates and the groups it talks on.

    Owns nothing but sub-group handles; the default group (``world``) belongs to whoever called
    ``init_rank``. Rank 0 of ``world`` is the instance's leader (it decides each tick).
    """

    config: ParallelConfig
    device: torch.device
    rank: int
    """Global rank in the instance."""
    mesh: DeviceMesh
    """The (cfg, ring, ulysses) mesh; diffusers' context parallel reads its ring/ulysses dims."""
    cfg_index: int
    """Which half of the rows this rank computes (0 when cfg == 1)."""
    sequence_index: int
    """Position in the sequence group (ring_index × ulysses + ulysses_index)."""

    @classmethod
    def build(cls, config: ParallelConfig, device: str | torch.device = "cpu") -> ParallelGroups:
        """Build from the initialised default group (a collective: every rank calls it)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call triptych.parallel.init_rank first")
        config.check_world_size(dist.get_world_size())
        device = torch.device(device)
        override = _group_config(default_backend(device), _default_group_timeout(device))
        mesh = init_device_mesh(
            device.type,
            (config.cfg, config.ring, config.ulysses),
            mesh_dim_names=MESH_DIMS,
            backend_override=dict.fromkeys(MESH_DIMS, override),
        )
        # diffusers' ContextParallelConfig.setup flattens ("ring", "ulysses") under this default name and
        # reuses an existing flattened mesh: create it here, with the timeout (``sequence_group``).
        mesh["ring", "ulysses"]._flatten(backend_override=override)
        rank = dist.get_rank()
        cfg_index = mesh.get_local_rank("cfg")
        sequence_index = mesh.get_local_rank("ring") * config.ulysses + mesh.get_local_rank("ulysses")
        assert rank == cfg_index * config.sequence_degree + sequence_index, (rank, cfg_index, sequence_index)
        logger.debug("rank %d: cfg index %d, sequence index %d, mesh %s", rank, cfg_index, sequence_index, mesh)
        return cls(config, device, rank, mesh, cfg_index, sequence_index)

    @property
    def world(self) -> dist.ProcessGroup:
        """Every rank of the instance (the default group)."""
        return dist.group.WORLD

    @property
    def cfg_group(self) -> dist.ProcessGroup:
        """The ranks at this rank's sequence position, one per CFG half (size ``config.cfg``)."""
        return self.mesh.get_group("cfg")

    @property
    def sequence_group(self) -> dist.ProcessGroup:
        """The ranks sharing this rank's rows, each holding a shard of every row's tokens (size
        ``config.sequence_degree``; diffusers gathers the model output over it)."""
        return self.mesh["ring", "ulysses"]._flatten().get_group()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0
