"""Step-boundary preemption with parking on real (tiny) models: a more urgent request takes the
batch, the displaced requests are parked and resumed, and each finishes exactly as it would have
without preemption in the same batches; parked memory is bounded, counted and freed (finish, abort).
The runs compared against are the engine's own unpreempted ones, which tests/pipelines/test_flux.py
and test_engine_batching.py hold to the pristine diffusers pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

import triptych
from tests.helpers import DenoiserPort as Port
from tests.helpers import denoise_job
from triptych.control import protocol as P
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.engine.parking import ParkingLot, state_bytes
from triptych.engine.teacache import make_teacache
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.worker.runners.denoiser import DenoiserRunner

DEFAULT = Path(triptych.__file__).parent / "assets" / "default"
URGENT = EngineConfig(max_batch_requests=2, lower_class_places=0)  # an urgent request runs with its class only


@pytest.fixture(scope="module")
def flux(tiny_model_dir):
    return load_family(tiny_model_dir("flux"))


def _params(family, i, **kw):
    p = GenerationParams(prompt=f"a shape number {i}", seed=200 + i, steps=3 + i % 2, guidance=2.0, **kw)
    return family.resolve(p)


def _add(engine, family, rid, p):
    state = family.prepare(rid, p, family.encode(p))
    engine.add(state)
    return state


def _run(engine, watch=None) -> dict:
    finished = {}
    while engine.has_work():
        out = engine.step()
        if watch is not None:
            watch(out)
        finished.update({s.request_id: s for s in out.finished})
    return finished


def _unpreempted(family, params: dict, config=EngineConfig(max_batch_requests=2)) -> dict:
    engine = DenoiserEngine(family, config)
    for rid, p in params.items():
        _add(engine, family, rid, p)
    return _run(engine)


def test_preempted_requests_are_parked_resumed_and_bit_identical_to_the_same_batches_unpreempted(flux):
    """a and b step together; an urgent request joins and runs alone while both are parked; they
    resume together where they stood. Same batches as a and b alone, so the same bits."""
    low = {"a": _params(flux, 0), "b": _params(flux, 1)}
    urgent = _params(flux, 2, priority=-1)
    engine = DenoiserEngine(flux, URGENT)
    states = {rid: _add(engine, flux, rid, p) for rid, p in low.items()}
    expected = state_bytes([s for st in states.values() for s in (st, st.scheduler)])
    assert engine.step().batch == ["a", "b"]
    _add(engine, flux, "urgent", urgent)
    seen = []
    finished = _run(engine, lambda out: seen.append((out.batch, engine.stats.parked, engine.stats.parked_bytes)))
    assert seen[: urgent.steps] == [(["urgent"], 2, expected)] * urgent.steps  # parked while it ran
    assert seen[urgent.steps][0] == ["a", "b"] and seen[urgent.steps][1:] == (0, 0)  # resumed together
    assert engine.stats.preemptions == 2 and engine.stats.parked == engine.stats.parked_bytes == 0
    reference = _unpreempted(flux, low)
    for rid in low:
        assert finished[rid].latents.equal(reference[rid].latents), rid
    alone = _unpreempted(flux, {"urgent": urgent})["urgent"]
    assert finished["urgent"].latents.equal(alone.latents)


def test_without_lower_class_places_the_urgent_request_shares_the_batch_and_nothing_is_parked(flux):
    engine = DenoiserEngine(flux, EngineConfig(max_batch_requests=2))
    _add(engine, flux, "a", _params(flux, 0))
    engine.step()
    _add(engine, flux, "urgent", _params(flux, 2, priority=-1))
    assert sorted(engine.step().batch) == ["a", "urgent"] and engine.stats.preemptions == 0


def test_only_the_request_the_urgent_one_displaced_is_parked_not_those_waiting_their_turn(flux):
    """Batches of 2, three requests of one class: a and b would run, c waits its turn. An urgent
    request takes b's place: b is parked, c (which would not have run either way) waits unparked."""
    engine = DenoiserEngine(flux, EngineConfig(max_batch_requests=2))
    for rid, i in (("a", 0), ("b", 1), ("c", 3)):
        _add(engine, flux, rid, _params(flux, i))
    _add(engine, flux, "urgent", _params(flux, 2, priority=-1))
    assert engine.step().batch == ["urgent", "a"]
    assert engine.parked_requests() == ["b"] and engine.stats.preemptions == 1


def test_the_cap_parks_what_fits_and_the_rest_waits_where_it_is(flux):
    low = {"a": _params(flux, 0), "b": _params(flux, 1)}
    probe = flux.prepare("probe", low["a"], flux.encode(low["a"]))
    one = state_bytes([probe, probe.scheduler])
    engine = DenoiserEngine(flux, EngineConfig(max_batch_requests=2, lower_class_places=0, max_parked_bytes=one))
    for rid, p in low.items():
        _add(engine, flux, rid, p)
    engine.step()
    _add(engine, flux, "urgent", _params(flux, 2, priority=-1))
    engine.step()
    assert engine.parked_requests() == ["a"] and engine.stats.parked_bytes == one <= engine.config.max_parked_bytes
    finished = _run(engine)
    assert engine.stats.preemptions == 1 and engine.stats.parked_bytes == 0
    reference = _unpreempted(flux, low)
    assert all(finished[rid].latents.equal(reference[rid].latents) for rid in low)


@pytest.fixture(scope="module")
def default_family():
    return load_family(DEFAULT)


def _teacache_engine(family, offload: bool = False):
    engine = DenoiserEngine(family, URGENT, accel=make_teacache(family))
    if offload:  # the copy to host and back a CUDA device makes, here from CPU memory to CPU memory
        engine._parking = ParkingLot(URGENT.max_parked_bytes, family.device, offload=True)
    return engine


@pytest.mark.parametrize("offload", [False, True], ids=["counted", "copied"])
def test_a_preempted_teacache_request_parks_its_cache_state_and_matches_its_run_alone(default_family, offload):
    """TeaCache's per-request residuals are parked with the request (counted in its bytes) and its
    skip decisions after resuming are those of its run alone: the same latents, bit for bit. Copied:
    every parked tensor is replaced by a copy (as on CUDA), and the result still holds."""
    family = default_family
    low = family.resolve(GenerationParams(prompt="a red circle", seed=5, teacache_threshold=0.3))
    urgent = family.resolve(GenerationParams(prompt="a blue square", seed=6, steps=2, priority=-1))
    engine = _teacache_engine(family, offload)
    state = _add(engine, family, "low", low)
    for _ in range(3):
        engine.step()
    cache = engine.accel.request_states("low")
    assert cache  # its cache state exists after a few steps
    residual, latents = cache[0].residual, state.latents
    _add(engine, family, "urgent", urgent)
    engine.step()
    assert engine.parked_requests() == ["low"]
    assert engine.stats.parked_bytes > state_bytes([state, state.scheduler])  # the cache state counted too
    assert (cache[0].residual is not residual and state.latents is not latents) == offload
    finished = _run(engine)
    alone_engine = _teacache_engine(family)
    _add(alone_engine, family, "low", low)
    alone = _run(alone_engine)["low"]
    assert finished["low"].latents.equal(alone.latents)
    assert alone_engine.accel.stats.rows_skipped > 0  # TeaCache did skip: the state mattered


def test_cancelling_a_parked_request_frees_its_parked_memory_and_cache_state(default_family):
    family = default_family
    low = family.resolve(GenerationParams(prompt="a red circle", seed=5, teacache_threshold=0.3))
    urgent = family.resolve(GenerationParams(prompt="a blue square", seed=6, steps=3, priority=-1))
    engine = _teacache_engine(family)
    _add(engine, family, "low", low)
    engine.step()
    engine.step()
    _add(engine, family, "urgent", urgent)
    engine.step()
    assert engine.parked_requests() == ["low"] and engine.stats.parked_bytes > 0
    assert engine.abort("low")
    assert engine.stats.parked == engine.stats.parked_bytes == 0 and engine.parked_requests() == []
    assert "low" not in engine.accel.active_requests() and engine.request_ids() == ["urgent"]
    assert list(_run(engine)) == ["urgent"]
    assert engine.accel.num_states() == 0 and not engine.has_work()


def _admit(runner, family, rid, p):
    job = denoise_job(rid, p)
    runner.admit(job, family.prepare(rid, p, family.encode(p)))
    return job


def test_the_denoiser_reports_each_request_s_mean_tick_time_and_occupancy(flux):
    """What the head's step costs learn from (``DenoiseDone.tick_s``, ``occupancy``): a (4 steps)
    shares 3 ticks with b (3 steps) and runs its last alone: occupancy 7/4; b's is 2."""
    port = Port()
    runner = DenoiserRunner(flux, port, DenoiserEngine(flux, EngineConfig(max_batch_requests=2)))
    _admit(runner, flux, "a", _params(flux, 1))
    _admit(runner, flux, "b", _params(flux, 0))
    while runner.has_work():
        runner.execute()
    done = {m.request_id: m for m in port.sent if isinstance(m, P.DenoiseDone)}
    assert (done["a"].occupancy, done["b"].occupancy) == (1.75, 2.0)
    assert 0 < done["a"].tick_s <= done["a"].engine_s and 0 < done["b"].tick_s <= done["b"].engine_s
    assert runner._ticks == {} and port.failed == []  # nothing kept per request after it finished


def test_cancelling_a_parked_request_on_the_denoiser_frees_its_place_and_parked_memory(flux):
    port = Port()
    runner = DenoiserRunner(flux, port, DenoiserEngine(flux, URGENT))
    low = _admit(runner, flux, "low", _params(flux, 0))
    runner.execute()
    _admit(runner, flux, "urgent", _params(flux, 2, priority=-1))
    runner.execute()
    assert runner.engine.parked_requests() == ["low"] and runner.engine_running() == 2
    runner.abort(low)
    assert runner.engine_running() == 1 and runner.engine.stats.parked_bytes == 0
    assert "low" not in runner._jobs and "low" not in runner._ticks
    while runner.has_work():
        runner.execute()
    assert [m.request_id for m in port.sent if isinstance(m, P.DenoiseDone)] == ["urgent"]
