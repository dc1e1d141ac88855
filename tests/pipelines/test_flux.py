"""FLUX stage split vs FluxPipeline.__call__ (bit-identical), and batched vs alone (tolerance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import count_calls, flux_reference, pristine_pipeline
from triptych.calibration.metrics import psnr
from triptych.core.errors import InvalidParam
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family

# Batching changes CPU kernel reduction order (~6e-7 per forward, docs/exactness.md); over a few steps
# the latents of a request stepped inside a batch stay within this of the request stepped alone.
BATCH_LATENT_ATOL = 4e-6  # measured 4.8e-7 max abs, both models (two runs)
BATCH_MIN_PSNR_DB = 112.0  # measured 131.9 dB at worst (two runs)
FUSED_LATENT_ATOL = 9e-6  # CFG rows in one forward vs two: measured 9.5e-7 (two runs)


@pytest.fixture(scope="module", params=["flux", "flux-schnell"])
def model_dir(request, tiny_model_dir):
    return tiny_model_dir(request.param)


@pytest.fixture(scope="module")
def family(model_dir):
    return load_family(model_dir)


@pytest.fixture(scope="module")
def pristine(model_dir):
    """diffusers' FluxPipeline loaded afresh from the same directory: no Triptych code touches it."""
    return pristine_pipeline(model_dir)


CASES = [
    dict(prompt="a red circle on a blue background", seed=1),
    dict(prompt="a green square", seed=2, height=48, width=80, steps=3, guidance=5.0),
    dict(prompt="a yellow star", negative_prompt="blurry, low quality", true_cfg=4.0, seed=3, height=80, width=48),
]


@pytest.mark.parametrize("case", CASES, ids=["default", "non-square", "true-cfg-negative"])
def test_staged_equals_diffusers_bit_exact(family, pristine, case):
    params = family.resolve(GenerationParams(**case))
    reference = flux_reference(pristine, params)
    with count_calls(family.pipe.transformer) as calls:
        frames, _ = run_request(family, params, fuse_cfg=False)
    assert frames.array.shape == reference.shape
    assert np.abs(frames.array - reference).max() == 0.0
    branches = 2 if params.negative_prompt else 1
    assert len(calls) == params.steps * branches  # CFG branches as diffusers runs them: separate forwards


def _alone(family, params, fuse_cfg):
    state = family.prepare("alone", params, family.encode(params))
    while not state.done:
        family.denoise_step([state], fuse_cfg=fuse_cfg)
    return state


def test_batched_requests_match_alone_within_tolerance(family):
    a = family.resolve(GenerationParams(prompt="a red circle", seed=5, steps=4, guidance=2.0))
    b = family.resolve(GenerationParams(prompt="a blue triangle on white", seed=6, steps=2, guidance=6.0))
    alone = [_alone(family, p, fuse_cfg=False) for p in (a, b)]
    sa, sb = (family.prepare(f"r{i}", p, family.encode(p)) for i, p in enumerate((a, b)))
    with count_calls(family.pipe.transformer) as calls:
        while not (sa.done and sb.done):
            family.denoise_step([sa, sb])
    # b finishes after 2 steps; a runs its last 2 steps alone: one forward per step, both rows stacked.
    assert calls == [2, 2, 1, 1]
    for batched, ref, p in ((sa, alone[0], a), (sb, alone[1], b)):
        diff = (batched.latents - ref.latents).abs().max().item()
        assert diff <= BATCH_LATENT_ATOL, diff
        img_psnr = psnr(family.decode(batched.latents, p).array, family.decode(ref.latents, p).array)
        assert img_psnr >= BATCH_MIN_PSNR_DB, img_psnr


def test_fused_cfg_is_one_forward_and_close(family):
    p = family.resolve(GenerationParams(prompt="a red circle", negative_prompt="noise", true_cfg=3.0, seed=7))
    separate = _alone(family, p, fuse_cfg=False)
    with count_calls(family.pipe.transformer) as calls:
        fused = _alone(family, p, fuse_cfg=True)
    assert calls == [2] * p.steps  # cond and uncond rows in one forward per step
    assert (fused.latents - separate.latents).abs().max().item() <= FUSED_LATENT_ATOL


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(height=60), "height"),
        (dict(width=8), "width"),
        (dict(steps=0), "steps"),
        (dict(frames=5), "frames"),
        (dict(prompt=""), "prompt"),
        (dict(image=object()), "image"),
        (dict(negative_prompt="x"), "negative_prompt"),
        (dict(guidance=-1.0), "guidance"),
    ],
)
def test_bad_params_name_the_field(family, changes, field):
    with pytest.raises(InvalidParam) as err:
        family.resolve(GenerationParams(prompt="ok").replace(**changes))
    assert err.value.field == field
    assert field in str(err.value)


def test_roles_load_only_their_components(tiny_model_dir):
    from triptych.families.base import Role

    enc = load_family(tiny_model_dir("flux"), roles={Role.ENCODER})
    assert enc.pipe.transformer is None and enc.pipe.vae is None and enc.pipe.text_encoder is not None
    dec = load_family(tiny_model_dir("flux"), roles={Role.DECODER})
    assert dec.pipe.vae is not None and dec.pipe.transformer is None and dec.pipe.text_encoder_2 is None
    head = load_family(tiny_model_dir("flux"), roles=())
    assert head.pipe.vae is None and head.pipe.transformer is None
    # A weightless adapter still validates with the model's real geometry.
    assert head.resolve(GenerationParams(prompt="x")).height == 64
    with pytest.raises(InvalidParam):
        head.resolve(GenerationParams(prompt="x", height=72))


def test_stages_across_role_instances_are_exact(tiny_model_dir):
    """Encoder, denoiser and decoder as separate adapters (as in the pools) change nothing."""
    from triptych.families.base import Conditioning, Role

    d = tiny_model_dir("flux")
    enc, den, dec = (load_family(d, roles={r}) for r in (Role.ENCODER, Role.DENOISER, Role.DECODER))
    p = den.resolve(GenerationParams(prompt="a purple star", seed=11, negative_prompt="x", true_cfg=2.0))
    cond = Conditioning.from_flat({k: v.clone() for k, v in enc.encode(p).flat().items()})
    state = den.prepare("r", p, cond)
    while not state.done:
        den.denoise_step([state], fuse_cfg=True)
    split = dec.decode(state.latents.clone(), p).array
    whole, _ = run_request(load_family(d), p, fuse_cfg=True)
    assert np.abs(split - whole.array).max() == 0.0
    assert torch.equal(torch.from_numpy(split), torch.from_numpy(whole.array))
