"""Wan 2.1 text-to-video and image-to-video families against diffusers' own pipelines.

Tiny seeded checkpoints are built once per module. The reference is the ``__call__`` of diffusers'
own pipeline, loaded afresh from the same directory in the test (none of the family's geometry
settings on it); staged single requests must match it exactly, batched requests within a stated
tolerance (batching changes kernel reduction order on CPU). The tiny models' ``triptych.json`` sets
a 64-token prompt length, which diffusers does not read: the reference is passed it as the
``max_sequence_length`` argument, as a user would.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import pristine_pipeline, seeded
from triptych.calibration.metrics import psnr
from triptych.core.errors import InvalidParam
from triptych.families.base import GenerationParams, Role
from triptych.families.registry import load_family, make_tiny

# Batched vs alone, float32 CPU, T2V and I2V, per-branch and fused: latents measured 2.1e-6 max abs,
# frames 152.8 dB PSNR at worst (two runs); the bounds are 10x that / 20 dB under it.
LATENT_ATOL = 2e-5  # measured 2.1e-6 (two runs)
MIN_PSNR_DB = 133.0  # measured 152.8 dB (two runs)

FAMILIES = ("wan-t2v", "wan-i2v")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {name: make_tiny(name, root / name, seed=0) for name in FAMILIES}


@pytest.fixture(scope="module")
def families(model_dirs):
    return {name: load_family(path) for name, path in model_dirs.items()}


@pytest.fixture(scope="module")
def reference(model_dirs):
    """``reference(name, params)``: frames (F, H, W, 3) from a pristine diffusers pipeline."""
    pipes = {}

    def call(name, p):
        if name not in pipes:
            pipes[name] = pristine_pipeline(model_dirs[name])
        settings = json.loads((model_dirs[name] / "triptych.json").read_text())
        extra = {"image": p.image} if p.image is not None else {}
        return pipes[name](
            prompt=p.prompt,
            negative_prompt=p.negative_prompt,
            height=p.height,
            width=p.width,
            num_frames=p.frames,
            num_inference_steps=p.steps,
            guidance_scale=p.guidance,
            generator=seeded(p.seed),
            max_sequence_length=settings["max_sequence_length"],
            output_type="np",
            **extra,
        ).frames[0]

    return call


def _image(height: int = 40, width: int = 48, seed: int = 0) -> Image.Image:
    rgb = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(rgb)


def _params(name: str, **kw) -> GenerationParams:
    if name == "wan-i2v":
        kw.setdefault("image", _image())
    return GenerationParams(prompt=kw.pop("prompt", "a cat sitting on a red chair"), **kw)


def _staged(fam, params: GenerationParams, denoiser=None, decoder=None):
    denoiser, decoder = denoiser or fam, decoder or fam
    state = denoiser.prepare("r0", params, fam.encode(params))
    while not state.done:
        denoiser.denoise_step([state])
    return state.latents, decoder.decode(state.latents, params).array


class _CallCounter:
    """Forward hook on the transformer: the batch size of every call."""

    def __init__(self, module):
        self.batches: list[int] = []
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        self.batches.append(kwargs["hidden_states"].shape[0])

    def remove(self):
        self._handle.remove()


CASES = {
    "cfg": dict(guidance=5.0, seed=1),
    "no-cfg": dict(guidance=1.0, seed=2),
    "negative-nonsquare": dict(guidance=4.0, negative_prompt="blurry, low quality", height=32, width=48, seed=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", FAMILIES)
def test_staged_matches_pipeline_exactly(families, reference, name, case):
    fam = families[name]
    params = fam.resolve(_params(name, **CASES[case]))
    ref = reference(name, params)
    _, frames = _staged(fam, params)
    assert frames.shape == (params.frames, params.height, params.width, 3)
    assert frames.dtype == np.float32 and 0.0 <= frames.min() and frames.max() <= 1.0
    assert np.abs(frames - ref).max() == 0.0


@pytest.mark.parametrize("name", FAMILIES)
def test_split_roles_match_pipeline_exactly(reference, model_dirs, name):
    """Each role loads only its components (i2v's encoder also loads the VAE) and still agrees."""
    encoder = load_family(model_dirs[name], roles=[Role.ENCODER])
    denoiser = load_family(model_dirs[name], roles=[Role.DENOISER])
    decoder = load_family(model_dirs[name], roles=[Role.DECODER])
    assert denoiser.pipe.vae is None and decoder.pipe.transformer is None and encoder.pipe.transformer is None
    assert (encoder.pipe.vae is not None) == encoder.accepts_image  # i2v encodes the first frame
    params = encoder.resolve(_params(name, guidance=5.0, negative_prompt="blurry", height=48, width=32, seed=4))
    ref = reference(name, params)
    _, frames = _staged(encoder, params, denoiser=denoiser, decoder=decoder)
    assert np.abs(frames - ref).max() == 0.0


BATCH = (  # same size and frames; different seeds, guidance (CFG on and off) and step counts
    dict(guidance=5.0, steps=4, seed=11),
    dict(guidance=3.0, steps=6, seed=12, negative_prompt="blurry"),
    dict(guidance=1.0, steps=3, seed=13),
)


@pytest.fixture(scope="module")
def batch_alone(families):
    """Per family: the BATCH requests' params, conditionings and their runs alone (computed once)."""
    memo = {}

    def get(name):
        if name not in memo:
            fam = families[name]
            params = [fam.resolve(_params(name, height=32, width=48, **kw)) for kw in BATCH]
            conds = [fam.encode(p) for p in params]
            alone = []
            for i, (p, c) in enumerate(zip(params, conds)):
                state = fam.prepare(f"alone{i}", p, c)
                while not state.done:
                    fam.denoise_step([state])
                alone.append((state.latents, fam.decode(state.latents, p).array))
            memo[name] = params, conds, alone
        return memo[name]

    return get


@pytest.mark.parametrize("fuse_cfg", [False, True], ids=["per-branch", "fused"])
@pytest.mark.parametrize("name", FAMILIES)
def test_batched_requests_match_alone_within_tolerance(families, batch_alone, name, fuse_cfg):
    fam = families[name]
    params, conds, alone = batch_alone(name)
    states = [fam.prepare(f"r{i}", p, c) for i, (p, c) in enumerate(zip(params, conds))]
    counter = _CallCounter(fam.pipe.transformer)
    try:
        steps = 0
        while not all(s.done for s in states):
            active = [s for s in states if not s.done]
            before = len(counter.batches)
            stats = fam.denoise_step(states, fuse_cfg=fuse_cfg)
            calls = counter.batches[before:]
            groups = {b for s in active for b in s.branches()}
            assert len(calls) == stats.forwards == (1 if fuse_cfg else len(groups))
            assert sum(calls) == stats.rows == sum(len(s.branches()) for s in active)
            steps += 1
    finally:
        counter.remove()
    assert steps == max(p.steps for p in params)
    # The first step holds all three requests: 2 CFG rows + 2 CFG rows + 1 row.
    assert counter.batches[: 1 if fuse_cfg else 2] == ([5] if fuse_cfg else [3, 2])
    for state, p, (latents_alone, frames_alone) in zip(states, params, alone):
        assert state.step == p.steps
        latent_diff = (state.latents - latents_alone).abs().max().item()
        db = psnr(fam.decode(state.latents, p).array, frames_alone)
        assert latent_diff <= LATENT_ATOL, (p.seed, latent_diff)
        assert db >= MIN_PSNR_DB, (p.seed, db)


BAD = [
    ("frames", dict(frames=4)),
    ("frames", dict(frames=0)),
    ("height", dict(height=40)),
    ("width", dict(width=8)),
    ("steps", dict(steps=0)),
    ("negative_prompt", dict(guidance=1.0, negative_prompt="blurry")),
    ("true_cfg", dict(true_cfg=2.0)),
    ("prompt", dict(prompt="  ")),
]


@pytest.mark.parametrize("field,overrides", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
@pytest.mark.parametrize("name", FAMILIES)
def test_bad_params_raise_invalid_param(families, name, field, overrides):
    with pytest.raises(InvalidParam) as err:
        families[name].resolve(_params(name, **overrides))
    assert err.value.field == field
    assert err.value.rule


def test_t2v_refuses_an_image(families):
    with pytest.raises(InvalidParam) as err:
        families["wan-t2v"].resolve(GenerationParams(prompt="a cat", image=_image()))
    assert err.value.field == "image"


@pytest.mark.parametrize("image", [None, np.zeros((32, 32, 3), dtype=np.uint8)], ids=["missing", "not-pil"])
def test_i2v_needs_a_pil_image(families, image):
    with pytest.raises(InvalidParam) as err:
        families["wan-i2v"].resolve(GenerationParams(prompt="a cat", image=image))
    assert err.value.field == "image"


@pytest.mark.parametrize("name", FAMILIES)
def test_defaults_come_from_triptych_json(families, name):
    p = families[name].resolve(_params(name))
    assert (p.height, p.width, p.frames, p.steps, p.guidance) == (32, 32, 5, 4, 5.0)
    assert families[name].is_video


def test_requests_own_their_scheduler(families):
    """A reference call (which mutates ``pipe.scheduler``) does not leak into a request's sampler."""
    fam = families["wan-t2v"]
    params = fam.resolve(_params("wan-t2v", seed=5, steps=3))
    before, _ = _staged(fam, params)
    fam.reference_call(params.replace(steps=5), output_type="latent")
    after, _ = _staged(fam, params)
    assert torch.equal(before, after)


def test_a_video_row_costs_its_latent_positions_in_tokens(families):
    """Wan's latents are (batch, channels, frames, height, width): the engine's token unit
    (``Family.row_tokens``) is one latent position, the transformer's patches times the patch size."""
    fam = families["wan-t2v"]
    params = fam.resolve(_params("wan-t2v", seed=1, steps=2))
    state = fam.prepare("t", params, fam.encode(params))
    assert fam.row_tokens(state) == fam.sequence_tokens(params) * int(np.prod(fam.patch_size))
