"""The head's event counters, as typed fields: what the control plane, the registry, the orchestrator
and each request lifecycle (generations, chats) count, and the ``triptych_head_events{event}`` label
each field is exported under (``HeadCounters.labels``). A field is a label; no label is built at run
time from a message or an error class."""

from __future__ import annotations

import msgspec

from triptych.control.request_state import RequestState


class ControlCounters(msgspec.Struct):
    """Frames the control socket dropped (``listener.ControlPlane``)."""

    malformed: int = 0  # not a well-formed control message
    unauthenticated: int = 0  # not signed with the deployment's token
    replays_refused: int = 0  # an old sequence number, or a socket its session is not bound to
    stale_session: int = 0  # from a session its instance replaced


class RegistryCounters(msgspec.Struct):
    """What the instance registry saw of instances it does not know (``registry.InstanceRegistry``)."""

    from_unknown_instance: int = 0  # messages from an instance not registered
    rejoins_requested: int = 0  # such instances asked to register again


class LifecycleCounters(msgspec.Struct):
    """How one kind of request (generations or chats) ended, and what the head dropped of it."""

    done: int = 0
    failed: int = 0
    cancelled: int = 0
    timed_out: int = 0
    invalid: int = 0  # of ``failed``: a rule only the worker checks (a chat prompt past the context)
    retries: int = 0  # moves back to the queue after an instance died or failed retryably
    replacement_waits: int = 0  # of ``retries``: with no other instance of the role, waiting for one
    replacement_waits_expired: int = 0  # of ``failed``: none registered within the wait's bound
    dropped_after_end: int = 0  # a message for a request that had ended (e.g. pieces on the wire)
    done_after_end: int = 0  # a final answer for a request that had ended: a worker finished it anyway
    dropped_stale: int = 0  # a message of an older generation (or, chats: from another instance)
    dropped_misrouted: int = 0  # a message from an instance not charged with that stage of it
    deadline_refused: int = 0  # refused at once: the estimate to finish was past its deadline_s
    deadline_missed: int = 0  # of ``timed_out``: its deadline_s passed while it waited, before it ran

    def count_end(self, state: RequestState) -> None:
        """One request ended in ``state`` (a terminal one)."""
        if state is RequestState.DONE:
            self.done += 1
        elif state is RequestState.FAILED:
            self.failed += 1
        elif state is RequestState.CANCELLED:
            self.cancelled += 1
        elif state is RequestState.TIMED_OUT:
            self.timed_out += 1
        else:
            raise ValueError(f"{state} is not a terminal state")


class HeadCounters(msgspec.Struct):
    """Every counter of one orchestrator (``describe()["stats"]``, ``triptych_head_events``)."""

    control: ControlCounters = msgspec.field(default_factory=ControlCounters)
    registry: RegistryCounters = msgspec.field(default_factory=RegistryCounters)
    generations: LifecycleCounters = msgspec.field(default_factory=LifecycleCounters)
    chats: LifecycleCounters = msgspec.field(default_factory=LifecycleCounters)
    heartbeats: int = 0
    orphans_cancelled: int = 0  # jobs a worker held that the head did not: cancelled
    head_stalls: int = 0  # ticks of the head's own loop late past a heartbeat interval (excused)
    instances_lost: int = 0  # instances declared dead

    def labels(self) -> dict[str, int]:
        """Each non-zero counter under its event label: a field's name, a chat's prefixed ``chat_``."""
        parts = ((self.control, ""), (self.registry, ""), (self.generations, ""), (self.chats, "chat_"))
        out = {prefix + name: getattr(part, name) for part, prefix in parts for name in part.__struct_fields__}
        out.update((name, n) for name in self.__struct_fields__ if isinstance(n := getattr(self, name), int))
        return {label: n for label, n in out.items() if n}
