"""Continuous step batching on a real (tiny) FLUX: joins at step boundaries, one forward per tick,
each request matches its run alone within the stated tolerance."""

from __future__ import annotations

import pytest

from tests.helpers import count_calls, denoise_job
from triptych.calibration.metrics import psnr
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family

# Batching changes CPU reduction order (~6e-7 per forward). Over the 5 requests: latents measured
# 2.4e-7 to 6.0e-7 max abs, decoded images 131.9 dB PSNR at worst (two runs).
LATENT_ATOL = 6e-6  # measured 6.0e-7 (two runs)
MIN_PSNR_DB = 112.0  # measured 131.9 dB (two runs)


@pytest.fixture(scope="module")
def family(tiny_model_dir):
    return load_family(tiny_model_dir("flux"))


def _params(family, i):
    return family.resolve(
        GenerationParams(
            prompt=f"a shape number {i}",
            seed=100 + i,
            steps=2 + i % 3,
            guidance=1.5 + i,
            negative_prompt="blur" if i % 2 else None,
            true_cfg=2.5 if i % 2 else 1.0,
        )
    )


def _alone(family, params, fuse_cfg):
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=fuse_cfg))
    engine.add(family.prepare("alone", params, family.encode(params)))
    return engine.run_until_done()[0]


def test_requests_join_mid_flight_and_match_alone(family):
    params = [_params(family, i) for i in range(5)]
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=8, fuse_cfg=True))
    finished = {}
    with count_calls(family.pipe.transformer) as calls:
        for i, p in enumerate(params):  # one new request joins at every step boundary
            engine.add(family.prepare(f"r{i}", p, family.encode(p)))
            finished.update({s.request_id: s for s in engine.step().finished})
        for s in engine.run_until_done():
            finished[s.request_id] = s
    assert len(calls) == engine.stats.forwards == engine.stats.steps  # one forward per tick, never a loop
    assert max(calls) > 2  # several requests (and their CFG rows) shared a forward
    assert max(engine.stats.batch_sizes) >= 3
    assert not engine.has_work()
    for i, p in enumerate(params):
        ref = _alone(family, p, fuse_cfg=True)
        got = finished[f"r{i}"]
        assert got.step == p.steps
        assert (got.latents - ref.latents).abs().max().item() <= LATENT_ATOL
        assert psnr(family.decode(got.latents, p).array, family.decode(ref.latents, p).array) >= MIN_PSNR_DB


def test_single_request_through_engine_is_bit_identical_to_denoise_loop(family):
    p = _params(family, 1)
    state = family.prepare("x", p, family.encode(p))
    while not state.done:
        family.denoise_step([state], fuse_cfg=True)
    assert (_alone(family, p, fuse_cfg=True).latents == state.latents).all()


def test_abort_removes_request_and_others_continue(family):
    engine = DenoiserEngine(family)
    for i in range(3):
        p = _params(family, i)
        engine.add(family.prepare(f"r{i}", p, family.encode(p)))
    engine.step()
    assert engine.abort("r1") and not engine.abort("r1")
    done = engine.run_until_done()
    assert sorted(s.request_id for s in done) == ["r0", "r2"]
    assert engine.stats.aborted == 1 and len(engine) == 0


def test_incompatible_sizes_never_share_a_forward(family):
    engine = DenoiserEngine(family)
    a = family.resolve(GenerationParams(prompt="a", steps=2))
    b = family.resolve(GenerationParams(prompt="b", steps=2, height=32, width=48))
    for rid, p in (("a", a), ("b", b)):
        engine.add(family.prepare(rid, p, family.encode(p)))
    batches = []
    while engine.has_work():
        batches.append(engine.step().batch)
    assert all(len(b) == 1 for b in batches) and len(batches) == 4


def test_a_tick_that_raises_evicts_its_batch_and_the_rest_run_on_bit_identically(family, monkeypatch):
    """A forward that raises (an out-of-memory, a kernel error) fails the requests of that tick and
    only those: they leave the engine, reported in ``failed``; another batch keeps stepping and ends
    exactly where it would have without the failure."""
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1))
    params = {f"r{i}": _params(family, i) for i in range(3)}
    for rid, p in params.items():
        engine.add(family.prepare(rid, p, family.encode(p)))
    real = family.forward

    def forward(rows):
        if any(r.state.request_id == "r1" for r in rows):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(rows)

    monkeypatch.setattr(family, "forward", forward)
    failed, finished = [], {}
    while engine.has_work():
        out = engine.step()
        failed += out.failed
        finished.update({s.request_id: s for s in out.finished})
    assert [(rid, str(e)) for rid, e in failed] == [("r1", "CUDA out of memory (simulated)")]
    assert engine.stats.failed == 1 and engine.stats.aborted == 0 and len(engine) == 0
    assert not engine.abort("r1")  # gone already: the worker's drop after the failure is a no-op
    monkeypatch.setattr(family, "forward", real)
    assert sorted(finished) == ["r0", "r2"]
    for rid in finished:
        assert (finished[rid].latents == _alone(family, params[rid], fuse_cfg=True).latents).all()


def test_the_denoiser_worker_fails_an_evicted_request_as_retryable_and_keeps_serving(family, monkeypatch):
    """The worker half of eviction: the evicted request's job gets a retryable ``StageError`` (the head
    retries it on another denoiser), the other request's progress is still sent."""
    from triptych.control import protocol as P
    from triptych.worker.runners.denoiser import DenoiserRunner

    sent, failures = [], []

    class Port:
        instance_id = "d0"
        send = sent.append

        def owns(self, job):
            return True

        def fail(self, job, error, retryable):
            failures.append((job.request_id, retryable))

    runner = DenoiserRunner(family, Port(), DenoiserEngine(family, EngineConfig(max_batch_requests=1)))
    for rid in ("bad", "good"):
        p = _params(family, 0)
        runner.admit(denoise_job(rid, p, progress=True), family.prepare(rid, p, family.encode(p)))
    real = family.forward
    monkeypatch.setattr(
        family,
        "forward",
        lambda rows: (_ for _ in ()).throw(RuntimeError("boom")) if rows[0].state.request_id == "bad" else real(rows),
    )
    while runner.has_work():
        runner.execute()
    assert failures == [("bad", True)]
    assert [m.request_id for m in sent if isinstance(m, P.DenoiseDone)] == ["good"]
    progress = [p.request_id for m in sent if isinstance(m, P.TickReport) for p in m.progress]
    assert "bad" not in progress and progress.count("good") == _params(family, 0).steps


def test_a_failed_tick_frees_its_memory_at_once(family, monkeypatch):
    """The failure reported for an evicted request carries no traceback: the tick's frames (and the
    batch's tensors they reference) are freed when the tick returns, not at some later cyclic GC
    (on a GPU an out-of-memory must give its memory back before the next tick)."""
    import gc
    import weakref

    import torch

    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1))
    p = _params(family, 0)
    engine.add(family.prepare("big", p, family.encode(p)))
    held = []

    def forward(rows):
        activations = torch.zeros(1 << 20)  # stands for the batch's activations, referenced by this frame
        held.append(weakref.ref(activations))
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(family, "forward", forward)
    gc.disable()
    try:
        out = engine.step()
        assert [rid for rid, _ in out.failed] == ["big"]
        assert held and held[0]() is None, "the failed tick's tensors are still referenced"
    finally:
        gc.enable()


def test_run_request_raises_a_failed_tick_and_stops_at_a_raising_callback(family, monkeypatch):
    """In process nobody retries: the engine's evicted failure leaves ``run_request`` as the error
    itself (not a silently unfinished request), and a callback that raises (the in-process backend's
    cancel) stops the request at that step."""
    from triptych.engine.runner import run_request

    p = _params(family, 1)  # 3 steps
    real = family.forward

    def broken(rows):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(family, "forward", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        run_request(family, p)
    monkeypatch.setattr(family, "forward", real)

    class Stop(Exception):
        pass

    seen = []

    def on_step(state):
        seen.append(state.step)
        if state.step == 1:
            raise Stop

    with pytest.raises(Stop):
        run_request(family, p, on_step=on_step)
    assert seen == [1]
    seen.clear()
    run_request(family, p, on_step=lambda s: seen.append(s.step))
    assert seen == [1, 2, 3]


def test_a_packed_row_costs_its_transformer_sequence_in_tokens(family):
    """The family tells the engine a row's token count (``Family.row_tokens``), from the state it
    prepared; for FLUX's packed latents that is the image stream the transformer sees."""
    p = _params(family, 0)
    state = family.prepare("t", p, family.encode(p))
    assert family.row_tokens(state) == family.sequence_tokens(p)


def test_a_higher_priority_request_takes_a_full_batch_at_the_next_step_and_both_stay_exact(family):
    """One request per batch: a priority -1 request that joins while a priority 0 one is mid-flight
    runs every tick until it finishes, then the other resumes where it stood (its state parked
    meanwhile); both match their runs alone bit for bit (a batch of one is a run alone)."""
    low = _params(family, 4)  # 3 steps
    urgent = _params(family, 2).replace(priority=-1)  # 4 steps
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1, fuse_cfg=True))
    engine.add(family.prepare("low", low, family.encode(low)))
    order = engine.step().batch
    engine.add(family.prepare("urgent", urgent, family.encode(urgent)))
    finished = {}
    while engine.has_work():
        out = engine.step()
        order += out.batch
        finished.update({s.request_id: s for s in out.finished})
    assert order == ["low", "urgent", "urgent", "urgent", "urgent", "low", "low"]
    for rid, p in (("low", low), ("urgent", urgent)):
        assert finished[rid].latents.equal(_alone(family, p, fuse_cfg=True).latents), rid
