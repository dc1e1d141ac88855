"""TeaCache on a multi-rank instance: the ranks skip the same rows as a single rank, decided once.

Each spawned group (gloo on loopback) runs, per family, two requests in one batch (A with TeaCache,
B without; both with CFG, different seeds and prompts, so the fused forward has 4 rows with padded
text): first on one rank with the single-rank engine (reference decisions and latents), then for
each parallel config with the instance's engine (``instance_engine``: TeaCache composed with the
ranks), on every rank. Profiles are fitted in the test on the same tiny models (8 steps).

Asserted: every rank's decisions (request, branch, step, compute) equal rank 0's and the single
rank's; some rows were skipped and some computed (the comparison is not vacuous); no rank's own
decision ever differed from the leader's (``overridden`` 0: decisions are broadcast, but with
identical inputs they agree anyway); the latents of both requests are within the parallel bound of
the single-rank TeaCache run. FLUX under Ulysses is refused with the reason (its ``_cp_plan`` splits
at the forward's inputs, which TeaCache's piecewise forward bypasses).
"""

from __future__ import annotations

import pytest
import torch

from triptych.parallel import ParallelConfig, ParallelGroups, apply_parallel, run_ranks

STEPS = 8
THRESHOLD = 0.3
FAMILIES = ("qwen-image", "wan-t2v")
# Max abs difference of the latents after 8 steps against the single-rank TeaCache run, float32, one
# thread; 10x the largest figure measured (beside it). The sources are those of
# tests/distributed/test_parallel.py (batch composition, attention reduction order), over 8 steps.
TOLERANCE = {
    ("qwen-image", "cfg2"): 7.2e-6,  # measured 7.15e-7
    ("qwen-image", "ulysses2"): 7.2e-6,  # measured 7.15e-7
    ("qwen-image", "ring2"): 7.2e-6,  # measured 7.15e-7
    ("wan-t2v", "cfg2"): 0.0,  # measured 0.0 (bit-identical)
    ("wan-t2v", "ulysses2"): 0.0,  # measured 0.0 (bit-identical, as in test_parallel.py)
    ("wan-t2v", "ring2"): 1.9e-5,  # measured 1.91e-6
}


def _params(family, name: str):
    from triptych.families.base import GenerationParams

    kw = dict(height=64, width=64, steps=STEPS, guidance=4.0)
    if name.startswith("wan"):
        kw.update(height=32, width=32, frames=5)
    a = GenerationParams("a red circle on blue", negative_prompt="noise", seed=1, teacache_threshold=THRESHOLD, **kw)
    b = GenerationParams("an old lighthouse on a cliff at night, oil painting", seed=2, **kw)
    return [family.resolve(a), family.resolve(b)]


def _run(family, plist, conds, engine) -> dict:
    states = [family.prepare(f"r{i}", p, cond) for i, (p, cond) in enumerate(zip(plist, conds))]
    for state in states:
        engine.add(state)
    decisions, tokens = [], []
    # the tokens reaching proj_out, where the model's _cp_plan gathers: the shard under sequence parallel
    handle = family.pipe.transformer.proj_out.register_forward_pre_hook(lambda m, args: tokens.append(args[0].shape[1]))
    try:
        while engine.has_work():
            out = engine.step()
            assert not out.failed, out.failed
            decisions += [(d.request_id, d.branch, d.step, d.compute) for d in engine.accel.last_decisions]
    finally:
        handle.remove()
    return dict(
        decisions=decisions,
        latents={s.request_id: s.latents for s in states},
        overridden=engine.accel.stats.overridden,
        tokens=max(tokens),
    )


def _rank_teacache(rank: int, device, dirs: dict, configs: list[dict]) -> dict:
    from triptych.core.errors import InvalidParam
    from triptych.engine import DenoiserEngine, EngineConfig
    from triptych.engine.teacache import make_teacache
    from triptych.families.registry import load_family
    from triptych.worker.ranks.ticks import instance_engine

    torch.set_num_threads(1)
    out: dict = {}
    for name in FAMILIES:
        family = load_family(dirs[name])
        plist = _params(family, name)
        conds = [family.encode(p) for p in plist]
        single = DenoiserEngine(family, EngineConfig(), accel=make_teacache(family))
        reference = _run(family, plist, conds, single)
        out[f"{name}/single"] = reference
        for config in configs:
            groups = ParallelGroups.build(ParallelConfig(**config), device)
            parallel = apply_parallel(family.pipe.transformer, groups)
            try:
                case = _run(family, plist, conds, instance_engine(family, EngineConfig(), parallel))
            finally:
                parallel.remove()
            case["diff"] = max((case["latents"][r] - reference["latents"][r]).abs().max().item() for r in ("r0", "r1"))
            out[f"{name}/{_mode(config)}"] = case
    flux = load_family(dirs["flux"])
    groups = ParallelGroups.build(ParallelConfig(ulysses=2), device)
    parallel = apply_parallel(flux.pipe.transformer, groups)
    try:
        engine = instance_engine(flux, EngineConfig(), parallel)
        p = flux.resolve(_flux_params())
        try:
            engine.add(flux.prepare("f0", p, flux.encode(p)))
            out["flux/refusal"] = None
        except InvalidParam as e:
            out["flux/refusal"] = str(e)
    finally:
        parallel.remove()
    return out


def _flux_params():
    from triptych.families.base import GenerationParams

    return GenerationParams("a red circle", height=32, width=32, steps=2, teacache_threshold=0.2)


def _mode(config: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in config.items())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from triptych.calibration.fit import calibrate
    from triptych.families.registry import load_family, make_tiny

    root = tmp_path_factory.mktemp("parallel-teacache")
    dirs = {name: str(make_tiny(name, root / name, seed=0)) for name in (*FAMILIES, "flux")}
    for name in FAMILIES:
        family = load_family(dirs[name])
        size = dict(height=32, width=32, frames=5) if name.startswith("wan") else dict(height=64, width=64)
        calibrate(
            family.model_dir,
            STEPS,
            prompts=("a red fox", "a lighthouse"),
            seeds=(0, 1),
            family=family,
            guidance=4.0,
            **size,
        )
    return dirs


@pytest.fixture(scope="module")
def forecast_dirs(model_dirs, tmp_path_factory):
    """Copies of the models whose profiles forecast the residual (``forecast`` 1)."""
    import dataclasses
    import shutil

    from triptych.accel.teacache_profile import load_profile, save_profile

    root = tmp_path_factory.mktemp("parallel-teacache-forecast")
    dirs = {name: str(shutil.copytree(d, root / name)) for name, d in model_dirs.items()}
    for name in FAMILIES:
        for path in (root / name / "teacache").glob("*.json"):
            save_profile(dataclasses.replace(load_profile(path), forecast=1), path)
    return dirs


def test_two_ranks_skip_the_same_rows_as_one_rank(model_dirs):
    _check_ranks(model_dirs)


def test_with_the_forecast_two_ranks_skip_the_same_rows_as_one_rank(forecast_dirs):
    """The forecast runs on each rank's own shard of the residuals (sequence parallel: its tokens)."""
    _check_ranks(forecast_dirs)


def _check_ranks(dirs):
    configs = [dict(cfg=2), dict(ulysses=2), dict(ring=2)]
    results = run_ranks(_rank_teacache, 2, (dirs, configs), timeout_s=300)
    leader = results[0]
    for name in FAMILIES:
        single = leader[f"{name}/single"]
        computes = [c for *_, c in single["decisions"]]
        assert any(computes) and not all(computes), f"{name}: no skip or no compute: the test would be vacuous"
        assert {r for r, *_ in single["decisions"]} == {"r0"}, "only request A uses TeaCache"
        for config in configs:
            key = f"{name}/{_mode(config)}"
            for rank, result in enumerate(results):
                assert result[key]["decisions"] == single["decisions"], f"{key}: rank {rank} decided differently"
                assert result[key]["overridden"] == 0, f"{key}: rank {rank} disagreed with the leader"
            assert leader[key]["diff"] <= TOLERANCE[(name, _mode(config))], f"{key}: {leader[key]['diff']:.3g}"
            if "cfg" not in config:  # the block stack really ran on this rank's half of the tokens
                assert leader[key]["tokens"] <= -(-single["tokens"] // 2), (
                    key,
                    leader[key]["tokens"],
                    single["tokens"],
                )
            for rank, result in enumerate(results[1:], start=1):
                for rid in ("r0", "r1"):
                    assert torch.equal(result[key]["latents"][rid], leader[key]["latents"][rid]), (key, rank, rid)
    for result in results:
        assert (
            result["flux/refusal"] is not None and "splits its tokens at its forward's inputs" in result["flux/refusal"]
        )
