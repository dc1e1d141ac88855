"""A denoiser whose LoRA budget is full of adapters in use makes a request wait for room instead of
failing it: the request joins once running requests release theirs, in arrival order inside a priority class,
and gives
the latents it gives alone. Requests naming no adapter never wait; one whose adapters cannot fit
even alone fails at once with the sizes; a waiting request that is aborted leaves nothing behind.

The budget holds either adapter but not both (sizes measured from the loaded adapters).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import DenoiserPort as Port
from tests.helpers import denoise_job, tiny_qwen_with_two_adapters
from triptych.control import protocol as P
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import GenerationParams
from triptych.families.qwenimage.family import QwenImageFamily
from triptych.worker.runners.base import Job
from triptych.worker.runners.denoiser import DenoiserRunner

STEPS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, config = tiny_qwen_with_two_adapters(tmp_path_factory.mktemp("lora_budget"))
    family = QwenImageFamily(model)
    family.enable_lora(config)
    sizes = {n: family.lora._load(n).nbytes for n in ("a", "b")}
    return family, config, sizes


def with_budget(family, config, nbytes: int):
    family.enable_lora(dataclasses.replace(config, lora_budget_mb=nbytes / (1 << 20)))
    return family


def params(family, i: int, lora):
    p = family.resolve(GenerationParams(prompt=f"shape number {i}", seed=20 + i, steps=STEPS, guidance=4.0))
    return p.replace(lora=lora)


def admit(runner, family, rid: str, p) -> Job:
    job = denoise_job(rid, p)
    runner.admit(job, family.prepare(rid, p, family.encode(p)))
    return job


def alone(family, rid: str, p) -> torch.Tensor:
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True))
    engine.add(family.prepare(rid, p, family.encode(p)))
    (state,) = engine.run_until_done()
    return state.latents


def done(port) -> list[str]:
    return [m.request_id for m in port.sent if isinstance(m, P.DenoiseDone)]


def test_a_request_waits_for_lora_room_and_joins_in_order(setup):
    family, config, sizes = setup
    family = with_budget(family, config, max(sizes.values()) + 16)
    port = Port()
    runner = DenoiserRunner(family, port, DenoiserEngine(family, EngineConfig(fuse_cfg=True)))
    plan = {"ra": (("a", 1.0),), "rb": (("b", 0.7),), "plain": (), "ra2": (("a", 0.5),)}
    ps = {rid: params(family, i, lora) for i, (rid, lora) in enumerate(plan.items())}
    for rid, p in ps.items():
        admit(runner, family, rid, p)
    # ra and plain run; rb waits for room, ra2 waits behind it (a is resident, but joining would keep
    # a in use and could starve rb).
    assert len(runner.engine) == 2 and runner.engine_running() == 4
    while runner.has_work():
        runner.execute()
    assert port.failed == []
    order = done(port)
    assert set(order[:2]) == {"ra", "plain"} and order[2:] == ["rb", "ra2"], order
    stats = family.lora.stats
    assert (stats.loaded, stats.evicted) == (3, 2), stats  # a, then b in a's place, then a in b's
    assert not family.lora.store.in_use()


def test_a_higher_priority_request_does_not_wait_behind_a_lower_one_for_lora_room(setup):
    """As above, but ra2 has priority -1: it is not held behind rb (priority 0) waiting for room;
    its adapter is resident, so it joins at once, and rb still joins once a is released."""
    family, config, sizes = setup
    family = with_budget(family, config, max(sizes.values()) + 16)
    port = Port()
    runner = DenoiserRunner(family, port, DenoiserEngine(family, EngineConfig(fuse_cfg=True)))
    plan = {"ra": ((("a", 1.0),), 0), "rb": ((("b", 0.7),), 0), "ra2": ((("a", 0.5),), -1)}
    for i, (rid, (lora, priority)) in enumerate(plan.items()):
        admit(runner, family, rid, params(family, i, lora).replace(priority=priority))
    assert len(runner.engine) == 2 and runner.engine_running() == 3
    while runner.has_work():
        runner.execute()
    order = done(port)
    assert port.failed == [] and set(order[:2]) == {"ra", "ra2"} and order[2:] == ["rb"], order


def test_each_waiting_request_gives_the_latents_it_gives_alone(setup):
    family, config, sizes = setup
    family = with_budget(family, config, max(sizes.values()) + 16)
    engine_out = {}
    port = Port()
    runner = DenoiserRunner(family, port, DenoiserEngine(family, EngineConfig(fuse_cfg=True)))
    original = runner.publish

    def publish(out):
        engine_out.update({s.request_id: s.latents.clone() for s in out.finished})
        original(out)

    runner.publish = publish
    ps = {"ra": params(family, 0, (("a", 1.0),)), "rb": params(family, 1, (("b", 0.7),))}
    for rid, p in ps.items():
        admit(runner, family, rid, p)
    while runner.has_work():
        runner.execute()
    assert sorted(engine_out) == ["ra", "rb"]
    for rid, p in ps.items():
        assert torch.equal(engine_out[rid], alone(family, rid, p)), rid


def test_an_adapter_that_cannot_fit_alone_fails_at_once_with_the_sizes(setup):
    family, config, sizes = setup
    family = with_budget(family, config, min(sizes.values()) - 1)
    port = Port()
    runner = DenoiserRunner(family, port, DenoiserEngine(family, EngineConfig(fuse_cfg=True)))
    big = "a" if sizes["a"] > sizes["b"] else "b"
    p = params(family, 0, ((big, 1.0),))
    job = denoise_job("r", p)
    job.incoming = family.encode(p).flat()
    runner.run(job)
    assert len(port.failed) == 1, port.failed
    rid, message, retryable = port.failed[0]
    assert rid == "r" and not retryable
    assert f"needs {sizes[big]} bytes" in message and "budget is" in message, message
    assert runner.engine_running() == 0 and not runner.has_work()


def test_an_aborted_waiting_request_never_runs_and_holds_nothing(setup):
    family, config, sizes = setup
    family = with_budget(family, config, max(sizes.values()) + 16)
    port = Port()
    runner = DenoiserRunner(family, port, DenoiserEngine(family, EngineConfig(fuse_cfg=True)))
    admit(runner, family, "ra", params(family, 0, (("a", 1.0),)))
    waiting = admit(runner, family, "rb", params(family, 1, (("b", 1.0),)))
    assert runner.engine_running() == 2 and len(runner.engine) == 1
    runner.abort(waiting)
    assert runner.engine_running() == 1
    while runner.has_work():
        runner.execute()
    assert done(port) == ["ra"] and port.failed == []
    assert not family.lora.store.in_use() and family.lora.store.loaded() == ["a"]
