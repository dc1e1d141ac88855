"""Parked requests: the state of a request preempted at a step boundary, held in bounded memory
off the compute device until its next step.

Contract: ``ParkingLot`` owns the accounting of parked state, never more than ``max_bytes`` in
all. ``park(request_id, parts)`` moves every tensor reachable from ``parts`` (a request's
``DenoiseState`` and its acceleration's per-request states: latents, conditioning, aux tensors,
step constants, its scheduler's tensors, TeaCache's residuals) off the device, in place, and
returns False without touching anything when they do not fit; ``resume(request_id, parts)`` moves
them back before the request's next step; ``drop(request_id)`` forgets a parked request that left
the engine (aborted, failed): its host copies go with its state. On a CUDA device the tensors move
to pinned host memory and back (an exact copy); on any other device they stay where they are and
are only counted. Adapter references are not parked: a parked request keeps its adapters
acquired until it finishes or is aborted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

Move = Callable[[torch.Tensor], torch.Tensor]


class ParkingLot:
    def __init__(self, max_bytes: int, device: torch.device, offload: bool | None = None) -> None:
        """``offload``: copy parked tensors to host memory (pinned when ``device`` is CUDA) and back;
        None = only on a CUDA device."""
        self.max_bytes = max_bytes
        self.device = torch.device(device)
        self.offload = self.device.type == "cuda" if offload is None else offload
        self._bytes: dict[str, int] = {}  # request id -> its parked bytes

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def __len__(self) -> int:
        return len(self._bytes)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._bytes

    def park(self, request_id: str, parts: Iterable[Any]) -> bool:
        """Park ``parts`` (see the module docstring); False (nothing moved) when they do not fit."""
        assert request_id not in self._bytes, request_id
        parts = list(parts)
        size = state_bytes(parts)
        if self.nbytes + size > self.max_bytes:
            return False
        if self.offload:
            pin = self.device.type == "cuda"
            move_tensors(parts, lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t))
        self._bytes[request_id] = size
        return True

    def resume(self, request_id: str, parts: Iterable[Any]) -> None:
        """Back onto the device for the next step; the accounting drops the request."""
        del self._bytes[request_id]
        if self.offload:
            device = self.device
            move_tensors(list(parts), lambda t: t.to(device, non_blocking=True))

    def drop(self, request_id: str) -> bool:
        """Forget a parked request that left the engine; False when it was not parked."""
        return self._bytes.pop(request_id, None) is not None


def state_bytes(parts: Iterable[Any]) -> int:
    """Bytes of the distinct tensors reachable from ``parts`` (a tensor shared by two parts counts once)."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    move_tensors(list(parts), lambda t: t, seen)
    return sum(t.numel() * t.element_size() for t, _ in seen.values() if isinstance(t, torch.Tensor))


def move_tensors(parts: list[Any], move: Move, memo: dict | None = None) -> None:
    """Replace, in place, every tensor reachable from ``parts`` by ``move(tensor)``: through dicts,
    lists and tuples and the fields of (non-frozen) dataclasses; a part that is not a dataclass (a
    diffusers scheduler) has its attributes walked (``sigmas``, ``timesteps``, multistep history),
    a nested one is left alone. A tensor reached twice is moved once, both places get the same
    copy; a container with nothing moved stays the same object."""
    memo = {} if memo is None else memo
    for part in parts:
        _walk_object(part, move, memo)


def _moved(value: Any, move: Move, memo: dict) -> Any:
    if isinstance(value, torch.Tensor):
        hit = memo.get(id(value))
        if hit is None:  # NOTE: the original is kept in the memo so its id cannot be reused meanwhile
            hit = memo[id(value)] = (value, move(value))
        return hit[1]
    if type(value) is dict:
        new = {k: _moved(v, move, memo) for k, v in value.items()}
        return value if all(new[k] is v for k, v in value.items()) else new
    if type(value) in (list, tuple):
        items = [_moved(v, move, memo) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        _walk_object(value, move, memo)
    return value


def _walk_object(obj: Any, move: Move, memo: dict) -> None:
    if isinstance(obj, (dict, list, tuple, torch.Tensor, torch.nn.Module)):
        raise TypeError(f"park objects that own their tensors (a state, a scheduler), not a {type(obj).__name__}")
    if ("object", id(obj)) in memo:
        return
    memo[("object", id(obj))] = (obj, obj)
    if dataclasses.is_dataclass(obj):
        if obj.__dataclass_params__.frozen:
            return
        names = [f.name for f in dataclasses.fields(obj)]
    else:
        names = list(vars(obj))
    for name in names:
        value = getattr(obj, name)
        new = _moved(value, move, memo)
        if new is not value:
            setattr(obj, name, new)
