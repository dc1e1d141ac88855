"""The parking lot's accounting and its tensor walk, with small fakes (the engine's use of it:
tests/pipelines/test_engine_preemption.py; the CUDA moves: tests/pipelines/test_gpu_parking.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from triptych.engine.parking import ParkingLot, move_tensors, state_bytes


@dataclass
class FakeState:
    latents: torch.Tensor
    cond: dict = field(default_factory=dict)
    history: list = field(default_factory=list)


class FakeScheduler:  # a diffusers scheduler keeps its tensors as plain attributes
    def __init__(self):
        self.sigmas = torch.ones(5)
        self.order = 1


def _parts(n: int = 4):
    shared = torch.zeros(n)
    return [FakeState(torch.zeros(n), {"a": shared}, [shared, torch.zeros(2 * n)]), FakeScheduler()]


def test_bytes_count_every_distinct_tensor_once():
    # float32: latents 4, shared 4 (twice reached), history 8, sigmas 5 -> 21 elements
    assert state_bytes(_parts()) == 21 * 4


def test_the_cap_refuses_a_request_that_does_not_fit_and_drop_frees_its_bytes():
    lot = ParkingLot(max_bytes=2 * 21 * 4 + 3, device=torch.device("cpu"))
    assert lot.park("a", _parts()) and lot.park("b", _parts())
    assert not lot.park("c", _parts())  # a third would pass the cap
    assert lot.nbytes == 2 * 21 * 4 and len(lot) == 2 and "c" not in lot
    assert lot.drop("a") and not lot.drop("a") and not lot.drop("c")
    lot.resume("b", _parts())
    assert lot.nbytes == 0 and len(lot) == 0
    assert ParkingLot(0, torch.device("cpu")).park("x", _parts()) is False  # 0: park nothing


def test_on_a_cpu_nothing_moves():
    parts = _parts()
    before = [parts[0].latents, parts[0].cond["a"], parts[1].sigmas]
    lot = ParkingLot(1 << 20, torch.device("cpu"))
    assert lot.park("r", parts) and lot.nbytes == 21 * 4  # counted
    after = [parts[0].latents, parts[0].cond["a"], parts[1].sigmas]
    assert all(a is b for a, b in zip(after, before))  # and left where it was


def test_move_reaches_fields_containers_and_scheduler_attributes_and_keeps_sharing():
    parts = _parts()
    old = {"latents": parts[0].latents, "shared": parts[0].cond["a"], "sigmas": parts[1].sigmas}
    move_tensors(parts, lambda t: t.double())
    state, sched = parts
    assert state.latents.dtype == sched.sigmas.dtype == state.history[1].dtype == torch.float64
    assert state.cond["a"] is state.history[0]  # one tensor reached twice: one copy, both places
    assert state.latents is not old["latents"] and sched.sigmas is not old["sigmas"]
    assert sched.order == 1


def test_a_frozen_dataclass_and_a_module_are_not_walked():
    @dataclass(frozen=True)
    class Params:
        scale: torch.Tensor

    @dataclass
    class WithParams:
        params: Params

    holder = WithParams(Params(torch.zeros(3)))
    move_tensors([holder], lambda t: t.double())
    assert holder.params.scale.dtype == torch.float32
    with pytest.raises(TypeError, match="Linear"):
        move_tensors([torch.nn.Linear(2, 2)], lambda t: t.double())
