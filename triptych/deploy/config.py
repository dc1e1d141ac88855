"""Cluster placement and autoscaling settings (``triptych serve`` flags; no Ray import here)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

from triptych.core.kinds import ROLES, Role


def parse_amounts(items: tuple[str, ...], what: str) -> dict[str, float]:
    """``("NAME=AMOUNT", ...)`` → ``{NAME: AMOUNT}``; raises ``ValueError`` naming ``what``."""
    out = {}
    for item in items:
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or value < 0:
            raise ValueError(f"{what}={item!r} must look like NAME=AMOUNT with AMOUNT >= 0")
        out[name.strip()] = value
    return out


@dataclass(frozen=True)
class RoleResources:
    """What one worker of a role asks Ray's scheduler for (each rank of a multi-rank denoiser asks
    this much again, in one STRICT_PACK placement group)."""

    cpus: float = 1.0
    """Logical CPUs reserved per worker (Ray's num_cpus); also its torch threads (at least 1) unless
    --threads is given."""
    gpus: float = 0.0
    """GPUs per worker (Ray's num_gpus; Ray sets CUDA_VISIBLE_DEVICES for it)."""
    memory_mb: int = 0
    """Memory reserved per worker in MiB (Ray's memory resource; 0 = none reserved)."""
    resources: tuple[str, ...] = ()
    """Custom Ray resources per worker, NAME=AMOUNT (repeat the flag): pins the role to the nodes that
    advertise NAME (e.g. ray start --resources '{"denoise": 2}')."""

    def __post_init__(self) -> None:
        if self.cpus < 0 or self.gpus < 0 or self.memory_mb < 0:
            raise ValueError(f"cpus={self.cpus}, gpus={self.gpus} and memory_mb={self.memory_mb} must be >= 0")
        parse_amounts(self.resources, "resources")

    @property
    def custom(self) -> dict[str, float]:
        return parse_amounts(self.resources, "resources")


@dataclass(frozen=True)
class ClusterConfig:
    """Where a head's workers run."""

    cluster: Literal["local", "ray"] = "local"
    """local: worker processes on this machine, supervised by the head; ray: the same worker command
    in Ray actors placed by the resources below (needs pip install 'triptych[ray]')."""
    ray_address: str = ""
    """The Ray cluster to join (HOST:PORT of its GCS); empty = start a Ray instance on this machine."""
    ray_node_ip: str = "127.0.0.1"
    """The address this driver and a Ray instance it starts use. Loopback (the default) keeps every
    Ray listener on 127.0.0.1 (Ray otherwise advertises the outward interface); give the machine's
    cluster address to join other machines."""
    ray_num_cpus: int = 0
    """Logical CPUs of a Ray instance started here; 0 = enough for the topology at its largest."""
    ray_max_restarts: int = 3
    """Restarts Ray gives a worker actor that died (process killed, node lost); -1 = no limit. Each
    restart registers as a new instance; requests it held are retried by the head."""
    encoder: RoleResources = field(default_factory=RoleResources)
    """Resources of each encoder actor (--encoder-cpus, --encoder-gpus, ...)."""
    denoiser: RoleResources = field(default_factory=RoleResources)
    """Resources of each denoiser rank (--denoiser-cpus, ...)."""
    decoder: RoleResources = field(default_factory=RoleResources)
    """Resources of each decoder actor (--decoder-cpus, ...)."""

    def __post_init__(self) -> None:
        if self.ray_num_cpus < 0:
            raise ValueError(f"ray_num_cpus={self.ray_num_cpus} must be >= 0")
        if self.ray_max_restarts < -1:
            raise ValueError(f"ray_max_restarts={self.ray_max_restarts} must be >= -1")
        try:
            ipaddress.ip_address(self.ray_node_ip)
        except ValueError:
            raise ValueError(f"ray_node_ip={self.ray_node_ip!r} must be an IP address") from None

    def resources(self, role: Role) -> RoleResources:
        return getattr(self, role)

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ray_node_ip).is_loopback


@dataclass(frozen=True)
class AutoscaleConfig:
    """Which pools grow and shrink, and on what signal (``autoscale.decide``)."""

    pools: tuple[str, ...] = ()
    """ROLE=MIN:MAX (repeat the flag), e.g. denoiser=1:4: that role's pool grows up to MAX instances
    under load and shrinks down to MIN when idle (a shrink drains an instance: nothing is dropped)."""
    up_queue: int = 2
    """Grow when at least this many requests wait for the role's slots ..."""
    up_wait_s: float = 2.0
    """... or the oldest of them has waited this long (seconds)."""
    down_idle_s: float = 10.0
    """Shrink when an instance of the role has been idle, with nothing waiting, this long (seconds)."""
    interval_s: float = 0.5
    """How often the autoscaler looks at the pools (seconds)."""

    def __post_init__(self) -> None:
        self.bounds()
        if self.up_queue < 1 or self.up_wait_s <= 0 or self.down_idle_s <= 0 or self.interval_s <= 0:
            raise ValueError(
                f"up_queue={self.up_queue} must be >= 1; up_wait_s={self.up_wait_s}, "
                f"down_idle_s={self.down_idle_s} and interval_s={self.interval_s} > 0"
            )

    def bounds(self) -> dict[Role, tuple[int, int]]:
        """Role → (MIN, MAX) instances, from ``pools``."""
        out = {}
        for item in self.pools:
            role, _, span = item.partition("=")
            lo, _, hi = span.partition(":")
            if role not in ROLES or not lo.isdigit() or not hi.isdigit() or not 0 <= int(lo) <= int(hi) or int(hi) < 1:
                raise ValueError(
                    f"pools={item!r} must look like ROLE=MIN:MAX, ROLE one of {ROLES!r}, 0 <= MIN <= MAX >= 1"
                )
            out[Role(role)] = (int(lo), int(hi))
        return out
