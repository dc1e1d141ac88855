"""Per-request step state for accelerations that wrap the denoiser's transformer call.

Accelerations such as TeaCache keep state between the steps of one request (previous inputs, cached
residuals). In a step-batching denoiser a batch holds many requests at different steps, each with
one or two CFG branches, so that state is keyed by ``(request_id, cfg_branch)`` and lives in a store
owned by whoever runs the batch (the engine), never on the transformer module.
Model: diffusers ``hooks/hooks.py`` (``StateManager``), but keyed per request instead of per
``cache_context``.

Ownership contract:
- an entry is created the first time a key is seen (``get_or_create``);
- the engine calls ``release(request_id)`` when the request finishes, fails or is aborted; that drops
  every branch of the request and returns how many entries it freed;
- nothing else removes entries, so ``len(store)`` after all requests are released is 0 (tests check
  this: no leak).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

StateKey = tuple[str, str]  # (request_id, cfg_branch)


class RequestStateStore(Generic[T]):
    """``(request_id, cfg_branch) -> T``; released per request."""

    def __init__(self) -> None:
        self._states: dict[str, dict[str, T]] = {}

    def get(self, request_id: str, branch: str) -> T | None:
        return self._states.get(request_id, {}).get(branch)

    def get_or_create(self, request_id: str, branch: str, factory: Callable[[], T]) -> T:
        branches = self._states.setdefault(request_id, {})
        if branch not in branches:
            branches[branch] = factory()
        return branches[branch]

    def of(self, request_id: str) -> dict[str, T]:
        """``request_id``'s states by branch (empty when it has none)."""
        return dict(self._states.get(request_id, {}))

    def release(self, request_id: str) -> int:
        """Drop every branch of ``request_id``; unknown ids are a no-op (abort before first step)."""
        return len(self._states.pop(request_id, {}))

    def requests(self) -> list[str]:
        return list(self._states)

    def __contains__(self, key: StateKey) -> bool:
        request_id, branch = key
        return branch in self._states.get(request_id, {})

    def __iter__(self) -> Iterator[StateKey]:
        return ((r, b) for r, d in self._states.items() for b in d)

    def __len__(self) -> int:
        return sum(len(d) for d in self._states.values())
