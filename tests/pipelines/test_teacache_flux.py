"""TeaCache on tiny FLUX: split forward exactness, the three-way test, CFG, batching, errors, lifetime.

The profile is fitted in the test on the same tiny model (8 steps, 2 prompts × 2 seeds; r2 0.68 over
28 points). Figures seen when written: threshold 0.2 skips 4 of 8 steps at 54.4 dB PSNR against the
uncached decode (0.1: 2 skips, 66.7 dB; 0.3: 5 skips, 50.3 dB); with true CFG 2.5 each branch skips 4
of 8, 53.9 dB; batched with two other requests a request makes the same decisions and its latents
stay within 3.6e-7 of the alone run. Asserted bounds: PSNR >= 35 dB (20 dB under the worst measured,
54.7 dB), batch tolerance 3e-6 (measured 3.6e-7; two runs each).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.pipelines.teacache_support import decoded_psnr
from triptych.accel.teacache import TeaCache
from triptych.accel.teacache_profile import ProfileIndex
from triptych.calibration.fit import calibrate
from triptych.core.errors import InvalidParam
from triptych.families.base import GenerationParams, Row
from triptych.families.registry import load_family, make_tiny

STEPS = 8
THRESHOLD = 0.2
MIN_PSNR_DB = 35.0  # quality at threshold 0.2: measured 54.7 dB (no CFG) / 54.9 dB (CFG) (two runs)
BATCH_ATOL = 3e-6  # batch composition changes kernel rounding only: measured 3.6e-7 (two runs)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    model = make_tiny("flux", tmp_path_factory.mktemp("flux") / "tiny-flux", seed=0, size="tiny")
    fam = load_family(model)
    calibrate(model, STEPS, prompts=("a red fox in the snow", "a lighthouse at night"), seeds=(0, 1), family=fam)
    return fam


@pytest.fixture
def block_calls(family):
    """Batch size of every block-stack call (pre-hook on the first double block)."""
    sizes: list[int] = []
    handle = family.pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda mod, args, kwargs: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    yield sizes
    handle.remove()


def new_cache(family):
    return TeaCache(family.teacache_plan(), ProfileIndex(family.model_dir, family.name))


def params(family, prompt="a small house by a lake", seed=3, threshold=0.0, **kw):
    return family.resolve(GenerationParams(prompt=prompt, seed=seed, steps=STEPS, teacache_threshold=threshold, **kw))


def run(family, plist, tc=None, fuse_cfg=False, stop_after=None):
    """Denoise requests ``r0..`` in one batch; returns states and per-request decision lists."""
    states = [family.prepare(f"r{i}", p, encode(family, p)) for i, p in enumerate(plist)]
    decisions = defaultdict(list)
    forward = tc.bind(family.forward) if tc is not None else None
    steps = 0
    while not all(s.done for s in states) and steps != stop_after:
        if tc is None:
            family.denoise_step(states, fuse_cfg=fuse_cfg)
        else:
            family.denoise_step(states, fuse_cfg=fuse_cfg, forward=lambda rows: _record(tc, forward, rows, decisions))
        steps += 1
    if tc is not None and stop_after is None:
        for s in states:
            tc.release(s.request_id)
    return states, decisions


_ENCODED: dict = {}


def encode(family, p):
    """Encodings are read-only inputs: share them between the runs of a test module."""
    key = (p.prompt, p.negative_prompt, family.uses_true_cfg(p))
    if key not in _ENCODED:
        _ENCODED[key] = family.encode(p)
    return _ENCODED[key]


def _record(tc, forward, rows, decisions):
    out = forward(rows)
    for d in tc.last_decisions:
        decisions[(d.request_id, d.branch)].append(d.compute)
    return out


def test_split_forward_is_bit_identical(family):
    plan = family.teacache_plan()
    p = params(family, negative_prompt="blurry", true_cfg=2.0)
    states = [family.prepare(f"r{i}", p.replace(seed=i), encode(family, p)) for i in range(2)]
    for rows in ([Row(states[0], "cond")], [Row(s, b) for b in ("cond", "uncond") for s in states]):
        with torch.no_grad():
            e = plan.embed(rows)
            assert torch.equal(plan.head(e, plan.blocks(e, None)), family.forward(rows))


def test_three_way(family, block_calls):
    base, _ = run(family, [params(family)])
    n_base = len(block_calls)
    tc = new_cache(family)
    off, _ = run(family, [params(family, threshold=0.0)], tc)
    assert torch.equal(off[0].latents, base[0].latents)
    block_calls.clear()
    on, decisions = run(family, [params(family, threshold=THRESHOLD)], tc)
    skipped = decisions[("r0", "cond")].count(False)
    assert skipped >= 2 and len(block_calls) == n_base - skipped < n_base
    assert decoded_psnr(family, on[0], base[0]) >= MIN_PSNR_DB
    again, _ = run(family, [params(family, threshold=0.0)], tc)
    assert torch.equal(again[0].latents, base[0].latents)
    assert tc.num_states() == 0


@pytest.mark.parametrize("fuse_cfg", [False, True])
def test_true_cfg_branches_keep_their_own_state(family, fuse_cfg):
    cfg = dict(negative_prompt="blurry, dark", true_cfg=2.5)
    base, _ = run(family, [params(family, **cfg)], fuse_cfg=fuse_cfg)
    tc = new_cache(family)
    off, _ = run(family, [params(family, **cfg)], tc, fuse_cfg=fuse_cfg)
    assert torch.equal(off[0].latents, base[0].latents)
    mid, _ = run(family, [params(family, threshold=THRESHOLD, **cfg)], tc, fuse_cfg=fuse_cfg, stop_after=3)
    assert set(tc._states) == {("r0", "cond"), ("r0", "uncond")}
    cond, uncond = tc._states.get("r0", "cond"), tc._states.get("r0", "uncond")
    assert not torch.equal(cond.previous_input, uncond.previous_input)
    assert not torch.equal(cond.residual, uncond.residual)
    tc.release("r0")
    on, decisions = run(family, [params(family, threshold=THRESHOLD, **cfg)], tc, fuse_cfg=fuse_cfg)
    assert set(decisions) == {("r0", "cond"), ("r0", "uncond")}
    assert all(len(d) == STEPS for d in decisions.values())
    assert sum(d.count(False) for d in decisions.values()) >= 2
    assert decoded_psnr(family, on[0], base[0]) >= MIN_PSNR_DB
    assert tc.num_states() == 0


def test_batched_request_decides_as_alone(family, block_calls):
    tc = new_cache(family)
    a = params(family, threshold=THRESHOLD)
    alone, alone_dec = run(family, [a], tc)
    b = params(family, prompt="a bowl of soup", seed=7)  # threshold 0
    c = params(family, prompt="a city at dusk", seed=5, threshold=THRESHOLD)
    block_calls.clear()
    batch, batch_dec = run(family, [a, b, c], tc)
    assert batch_dec[("r0", "cond")] == alone_dec[("r0", "cond")]
    assert (batch[0].latents - alone[0].latents).abs().max().item() <= BATCH_ATOL
    # one block-stack call per step, over the computing rows only (b always computes)
    computing = [1 + ca + cc for ca, cc in zip(batch_dec[("r0", "cond")], batch_dec[("r2", "cond")])]
    assert block_calls == computing and min(computing) < 3
    b_alone, _ = run(family, [b])
    assert (batch[1].latents - b_alone[0].latents).abs().max().item() <= BATCH_ATOL
    assert tc.num_states() == 0


def test_missing_profile_is_a_clear_error(family):
    tc = new_cache(family)
    p = params(family, threshold=THRESHOLD).replace(steps=6)  # no profile fitted for 6 steps
    with pytest.raises(InvalidParam, match="not calibrated for family 'flux' at 6 steps") as e:
        run(family, [p], tc)
    assert e.value.field == "teacache_threshold"
    tc.admit("r0", threshold=THRESHOLD, steps=6, coefficients=[0.0, 0.0, 0.0, 1.0, 0.0])  # explicit: allowed
    states, decisions = run(family, [p], tc)
    assert states[0].done and len(decisions[("r0", "cond")]) == 6 and tc.num_states() == 0


def test_abort_releases_state(family):
    tc = new_cache(family)
    run(family, [params(family, threshold=THRESHOLD, negative_prompt="x", true_cfg=2.0)], tc, stop_after=3)
    assert tc.num_states() == 2
    tc.release("r0")
    assert tc.num_states() == 0 and tc.active_requests() == []
