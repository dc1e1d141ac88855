"""Per-tenant (API key) scheduling policy, and the bounds of a request's scheduling fields
(``priority``, ``deadline_s``): the default priority of its requests, the priorities it
may ask for, and its weight in the head's fair queue (``triptych.control.fair_queue``).

A policy is written ``NAME:priority=P,min=A,max=B,weight=W`` (every part optional), NAME being one
of the server's API keys, a tenant id (``key-`` and 16 hex digits: ``state.tenant_of_key``, what
logs and metrics show, so a key need not be written twice), or ``*``: every tenant without a policy
of its own (and every request of a server without keys). Priorities are integers, lower sooner;
every bound lies inside ``PRIORITY_MIN .. PRIORITY_MAX``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from triptych.core.errors import InvalidParam

PRIORITY_MIN = -100
PRIORITY_MAX = 100
MAX_DEADLINE_S = 7 * 24 * 3600.0  # the longest deadline_s (a request's or a model's default)
ANY = "*"
_TENANT_ID = re.compile(r"^key-[0-9a-f]{16}$")


@dataclass(frozen=True)
class TenantPolicy:
    priority: int = 0  # a request's priority when it names none
    min_priority: int = PRIORITY_MIN  # the most urgent priority it may ask for
    max_priority: int = PRIORITY_MAX
    weight: float = 1.0  # its share in the fair queue against other tenants of the same class

    def __post_init__(self) -> None:
        if not PRIORITY_MIN <= self.min_priority <= self.priority <= self.max_priority <= PRIORITY_MAX:
            raise ValueError(
                f"priority bounds min={self.min_priority} <= priority={self.priority} <= max={self.max_priority} "
                f"must hold, inside {PRIORITY_MIN}..{PRIORITY_MAX}"
            )
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight={self.weight!r} must be a positive number")


_PARTS = {"priority": "priority", "min": "min_priority", "max": "max_priority", "weight": "weight"}


def parse_policy(spec: str) -> tuple[str, TenantPolicy]:
    """``NAME:priority=P,min=A,max=B,weight=W`` → (NAME, policy); ``ValueError`` naming the spec."""
    name, _, rest = spec.rpartition(":") if ":" in spec else (spec, "", "")
    name = name.strip()
    values: dict[str, float] = {}
    try:
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in _PARTS or _PARTS[key] in values:
                raise ValueError(f"{part!r}: each part is one of {', '.join(_PARTS)}=VALUE, once")
            values[_PARTS[key]] = float(value) if key == "weight" else int(value)
        if not name:
            raise ValueError("the name (an API key, a tenant id key-..., or *) is missing")
        if "priority" not in values:  # a default inside the bounds given
            lo, hi = values.get("min_priority", PRIORITY_MIN), values.get("max_priority", PRIORITY_MAX)
            values["priority"] = min(max(0, lo), hi)
        return name, TenantPolicy(**values)
    except ValueError as e:
        raise ValueError(f"tenant policy {_redacted(spec)}: {e}") from None


class Tenants:
    """The policies of a head's tenants, looked up by tenant id (``state.TENANT``)."""

    def __init__(self, specs: Iterable[str], api_keys: Iterable[str], tenant_of: Mapping[str, str]):
        """``tenant_of``: API key → tenant id (``state.tenant_of_key`` of each of ``api_keys``)."""
        keys = set(api_keys)
        self.default = TenantPolicy()
        self.by_tenant: dict[str, TenantPolicy] = {}
        seen: set[str] = set()
        for spec in specs:
            name, policy = parse_policy(spec)
            if name != ANY and name not in keys and not _TENANT_ID.match(name):
                raise ValueError(
                    f"tenant policy {_redacted(spec)}: the name is neither one of the API keys, a tenant id "
                    "(key- and 16 hex digits), nor *"
                )
            tenant = tenant_of.get(name, name)
            if tenant in seen:
                raise ValueError(f"tenant policy {_redacted(spec)}: a second policy for the same tenant")
            seen.add(tenant)
            if name == ANY:
                self.default = policy
            else:
                self.by_tenant[tenant] = policy

    def policy(self, tenant: str) -> TenantPolicy:
        return self.by_tenant.get(tenant, self.default)

    def priority(self, value: int | None, tenant: str) -> int:
        """The request's priority: ``value`` checked against its tenant's bounds, or the default."""
        policy = self.policy(tenant)
        if value is None:
            return policy.priority
        if not policy.min_priority <= value <= policy.max_priority:
            raise InvalidParam(
                "priority",
                value,
                f"must be between {policy.min_priority} and {policy.max_priority} for this API key (lower runs sooner)",
            )
        return value


def _redacted(spec: str) -> str:
    """A spec as an error shows it: without the API key it may start with."""
    name, sep, rest = spec.rpartition(":") if ":" in spec else (spec, "", "")
    name = name.strip()
    return repr(spec) if name == ANY or _TENANT_ID.match(name) else repr(f"<name>{sep}{rest}")
