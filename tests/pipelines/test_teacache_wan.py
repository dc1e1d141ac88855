"""TeaCache on tiny Wan 2.1 T2V and I2V: split forward exactness, three-way, CFG, lifetime.

The profile is fitted in the test on the same tiny model (8 steps, 5 frames of 32×48, 2 prompts × 2
seeds, CFG 5: 8 trajectories, 56 points; r2 0.78 for T2V, 0.47 for I2V: random tiny weights, the fit
is only a plumbing check). Modulated input: the timestep projection (see
``triptych.families.wan.teacache``). Figures seen when written (decoded PSNR against the uncached
run, skipped steps of 8, warmup 1 + cooldown 1 always compute):

============  =========================  =========================  =========================
threshold     wan-t2v                    wan-t2v, CFG 5             wan-i2v
============  =========================  =========================  =========================
0.1           1 skip, 122.7 dB           1 + 1 skips, 124.0 dB      0 skips (== baseline)
0.2 (tests)   3 skips, 50.4 dB           3 + 3 skips, 56.8 dB       3 skips, 47.0 dB
0.3           4 skips, 38.7 dB           4 + 4 skips, 38.4 dB       3 skips, 47.0 dB
0.5           5 skips, 39.0 dB           5 + 5 skips, 38.2 dB       5 skips, 45.3 dB
============  =========================  =========================  =========================

Asserted: split forward bit-identical to ``family.forward`` (one row; 2 requests × CFG with
different prompts, seeds and, for I2V, condition images), >= 2 skips and PSNR >= 35 dB at threshold
0.2. Batched with two other requests (one at threshold 0, other prompts) a request makes the same
decisions as alone and its latents stay within 9.5e-7 of the alone run (asserted 9e-6); each step is
one block-stack call over the computing rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.pipelines.teacache_support import condition_image, decoded_psnr, encode, new_cache, run
from triptych.calibration.fit import calibrate
from triptych.families.base import GenerationParams, Row
from triptych.families.registry import load_family

STEPS = 8
THRESHOLD = 0.2
MIN_PSNR_DB = 35.0  # measured 47.0 dB at worst (I2V; 50.4 T2V, 56.8 CFG) (two runs)
BATCH_ATOL = 9e-6  # batch composition changes kernel rounding only: measured 9.5e-7 (two runs)
SIZE = dict(height=32, width=48, frames=5)
FAMILIES = ("wan-t2v", "wan-i2v")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def extra(name):
    return dict(image=condition_image()) if name == "wan-i2v" else {}


@pytest.fixture(scope="module")
def families(tiny_model_dir):
    out = {}
    for name in FAMILIES:
        fam = load_family(tiny_model_dir(name))
        calibrate(
            fam.model_dir,
            STEPS,
            prompts=("a red fox in the snow", "a lighthouse at night"),
            seeds=(0, 1),
            family=fam,
            guidance=5.0,
            **SIZE,
            **extra(name),
        )
        out[name] = fam
    return out


@pytest.fixture(params=FAMILIES)
def family(request, families):
    return families[request.param]


def params(family, prompt="a small house by a lake", seed=3, threshold=0.0, **kw):
    kw = {"guidance": 1.0, **SIZE, **extra(family.name), **kw}
    return family.resolve(GenerationParams(prompt=prompt, seed=seed, steps=STEPS, teacache_threshold=threshold, **kw))


def mixed_rows(family):
    """Two requests, different prompts and seeds, both with CFG: 4 rows (Wan pads text to a fixed length)."""
    p1 = params(family, prompt="a red circle", guidance=4.0, negative_prompt="blurry")
    p2 = params(
        family,
        prompt="an old lighthouse on a cliff during a storm at night, oil painting",
        seed=5,
        guidance=3.0,
        **({"image": condition_image(8)} if extra(family.name) else {}),
    )
    states = [family.prepare(f"r{i}", p, encode(family, p)) for i, p in enumerate((p1, p2))]
    return [Row(states[0], "cond")], [Row(s, b) for b in ("cond", "uncond") for s in states]


@torch.no_grad()
def check_split(family):
    plan = family.teacache_plan()
    one, four = mixed_rows(family)
    for rows in (one, four):
        e = plan.embed(rows)
        assert torch.equal(plan.head(e, plan.blocks(e, None)), family.forward(rows))
    # a sub-batch of rows runs the same blocks on the same rows (only kernel batching differs)
    idx = torch.tensor([1, 2])
    assert (plan.blocks(e, idx) - plan.blocks(e, None)[idx]).abs().max().item() <= 1e-5
    assert plan.modulated_input(e).shape == e.timestep_proj.shape == (len(four), 6, e.hidden.shape[-1])


def test_split_forward_is_bit_identical(family):
    check_split(family)


def test_three_way(family):
    base, _ = run(family, [params(family)])
    tc = new_cache(family)
    off, _ = run(family, [params(family, threshold=0.0)], tc)
    assert torch.equal(off[0].latents, base[0].latents)
    on, decisions = run(family, [params(family, threshold=THRESHOLD)], tc)
    assert decisions[("r0", "cond")].count(False) >= 2
    assert decoded_psnr(family, on[0], base[0]) >= MIN_PSNR_DB
    again, _ = run(family, [params(family, threshold=0.0)], tc)
    assert torch.equal(again[0].latents, base[0].latents)
    assert tc.num_states() == 0


@pytest.mark.parametrize("fuse_cfg", [False, True])
def test_cfg_branches_keep_their_own_state(families, fuse_cfg):
    family = families["wan-t2v"]
    cfg = dict(guidance=5.0, negative_prompt="blurry, dark")
    base, _ = run(family, [params(family, **cfg)], fuse_cfg=fuse_cfg)
    tc = new_cache(family)
    run(family, [params(family, threshold=THRESHOLD, **cfg)], tc, fuse_cfg=fuse_cfg, stop_after=3)
    assert set(tc._states) == {("r0", "cond"), ("r0", "uncond")}
    cond, uncond = tc._states.get("r0", "cond"), tc._states.get("r0", "uncond")
    # The modulated input is the timestep projection: both branches measure the same change; each
    # still adds its own cached residual when it skips.
    assert torch.equal(cond.previous_input, uncond.previous_input)
    assert not torch.equal(cond.residual, uncond.residual)
    tc.release("r0")
    assert tc.num_states() == 0
    on, decisions = run(family, [params(family, threshold=THRESHOLD, **cfg)], tc, fuse_cfg=fuse_cfg)
    assert set(decisions) == {("r0", "cond"), ("r0", "uncond")}
    assert all(len(d) == STEPS for d in decisions.values())
    assert sum(d.count(False) for d in decisions.values()) >= 2
    assert decoded_psnr(family, on[0], base[0]) >= MIN_PSNR_DB
    assert tc.num_states() == 0 and tc.active_requests() == []


def test_batched_request_decides_as_alone(family):
    """A request makes the same decisions alone and next to others (one at threshold 0, other prompts);
    each step runs ONE block-stack call over the computing rows only."""
    sizes: list[int] = []

    def hook(mod, args, kwargs):
        sizes.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[0])

    tc = new_cache(family)
    a = params(family, threshold=THRESHOLD)
    alone, alone_dec = run(family, [a], tc)
    b = params(family, prompt="a bowl of soup on a wooden table", seed=7)  # threshold 0: always computes
    c = params(family, prompt="a city at dusk", seed=5, threshold=THRESHOLD)
    handle = family.pipe.transformer.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        batch, batch_dec = run(family, [a, b, c], tc)
    finally:
        handle.remove()
    assert batch_dec[("r0", "cond")] == alone_dec[("r0", "cond")]
    assert (batch[0].latents - alone[0].latents).abs().max().item() <= BATCH_ATOL
    computing = [1 + ca + cc for ca, cc in zip(batch_dec[("r0", "cond")], batch_dec[("r2", "cond")])]
    assert sizes == computing and min(computing) < 3
    b_alone, _ = run(family, [b])
    assert (batch[1].latents - b_alone[0].latents).abs().max().item() <= BATCH_ATOL
    assert tc.num_states() == 0
