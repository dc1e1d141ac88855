"""Parking on a CUDA device (skipped without one): a preempted request's state leaves the device for
pinned host memory while it waits, comes back for its next step, and the request ends bit-identical
to the same batches unpreempted on the device."""

from __future__ import annotations

import pytest

from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family

pytestmark = pytest.mark.gpu


def _params(family, i, **kw):
    return family.resolve(GenerationParams(prompt=f"a shape number {i}", seed=300 + i, steps=4, **kw))


def test_a_parked_request_leaves_the_device_and_resumes_bit_identically(tiny_model_dir):
    family = load_family(tiny_model_dir("flux"), device="cuda")
    low, urgent = _params(family, 0), _params(family, 1, steps=2, priority=-1)

    def run(preempt: bool):
        engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1, lower_class_places=0))
        state = family.prepare("low", low, family.encode(low))
        engine.add(state)
        engine.step()
        where = None
        if preempt:
            engine.add(family.prepare("urgent", urgent, family.encode(urgent)))
            engine.step()
            where = (state.latents.device.type, state.latents.is_pinned(), engine.stats.parked_bytes)
        finished = {}
        while engine.has_work():
            finished.update({s.request_id: s for s in engine.step().finished})
        return finished["low"].latents, where, engine.stats

    plain, _, _ = run(False)
    preempted, where, stats = run(True)
    assert where[:2] == ("cpu", True) and where[2] > 0  # on pinned host memory while parked
    assert preempted.device.type == "cuda" and preempted.equal(plain)
    assert stats.preemptions == 1 and stats.parked_bytes == 0
