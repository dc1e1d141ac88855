"""Retry bookkeeping shared by generation and chat routing: how often a request was retried, which
instances failed it (so a retry goes elsewhere while another instance of that role exists), and,
where none does, the wait for one to register (``replacement``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from triptych.control.dispatch import DispatchPolicy, Instance
from triptych.control.lora_affinity import prefer_holder
from triptych.control.replacement import ReplacementWait


@dataclass
class Attempts:
    retries: int = 0
    avoid: dict[str, set[str]] = field(default_factory=dict)  # role -> instances that failed this request
    #: (tenant, image hash) of the request's images, for the encoder's image affinity (set once)
    image_keys: list[tuple[str, str]] | None = None
    #: set while the retry waits for an instance of a role that had no other one (cleared once a slot
    #: of that role is charged to the request); past its ``until`` the request fails
    waiting: ReplacementWait | None = None

    def refusal(self, max_retries: int) -> str | None:
        """Why no retry may happen (None: it may): retries exhausted."""
        if self.retries >= max_retries:
            return f"retries exhausted ({self.retries})"
        return None

    def record(self, role: str | None, failed: str | None) -> None:
        """One more retry, away from ``failed``."""
        if role is not None and failed is not None:
            self.avoid.setdefault(role, set()).add(failed)
        self.retries += 1

    def pick(
        self,
        policy: DispatchPolicy,
        role: str,
        pool: list[Instance],
        affinity=None,
        chat: bool = False,
        loras: Sequence[str] = (),
    ) -> Instance | None:
        """The policy's choice among ``pool``, leaving out the instances that failed this request while
        any other is registered (it waits for that one's free slot rather than go back). With
        ``affinity`` (an ``affinity.ImageAffinity``; ``image_keys`` set), a free instance that holds
        the request's images comes first (``chat``: free in its chat slots); with ``loras`` (the request's
        adapters), a free instance holding them comes first (``lora_affinity``)."""
        avoid = frozenset(self.avoid.get(role, ()))
        if avoid and all(i.instance_id in avoid for i in pool):
            avoid = frozenset()
        if affinity is not None and self.image_keys:
            preferred = affinity.prefer(self.image_keys, pool, exclude=avoid, chat=chat)
            if preferred is not None:
                return preferred
        if loras:
            preferred = prefer_holder(loras, pool, exclude=avoid)
            if preferred is not None:
                return preferred
        return policy.pick(pool, exclude=avoid)
