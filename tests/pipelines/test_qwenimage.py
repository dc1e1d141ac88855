"""Qwen-Image and Qwen-Image-Edit: staged Triptych vs the diffusers pipeline, batching, validation.

Exactness: a single request through resolve → encode → prepare → denoise_step → decode equals the
pipeline's ``__call__`` bit for bit (float32, CPU). Batching: requests stepped together (different
prompts, lengths, seeds, guidance, step counts) stay within ``BATCH_LATENT_TOL`` of each request run
alone, in one transformer call per CFG group (one in all with ``fuse_cfg``).

The reference is diffusers' own pipeline loaded afresh from the model directory in the test
(``pristine_*`` fixtures): none of the family's geometry settings, no mm-cache hook, so the edit
reference shares no cached vision-tower output with the staged run. The tiny edit checkpoint saves
its processor as Triptych's torchvision-free ``QwenImageEditProcessor``, which diffusers cannot
import by name: the test passes it to ``from_pretrained`` as a component, as a user would.

NOTE: QwenImageEditPipeline resizes every condition image to ~1 MP, and the VAE's conv3d at that
size takes seconds on a shared CPU. The module patches the pipeline module's
``calculate_dimensions`` to a 256×256 area (a user of diffusers would do the same to change the
pipeline's hard-coded area); Triptych reads the same function, so the reference and the staged run
still see the same condition size and exactness is still checked.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from tests.helpers import pristine_pipeline, staged
from tests.helpers import qwen_reference as reference
from triptych.calibration.metrics import psnr
from triptych.core.errors import InvalidParam
from triptych.families.base import GenerationParams, Role
from triptych.families.qwenimage.encode import condition_size
from triptych.families.qwenimage.family import DEFAULT_NEGATIVE_PROMPT, QwenImageEditFamily, QwenImageFamily
from triptych.families.qwenimage.processor import load_processor
from triptych.families.qwenimage.tiny import make_tiny_qwen_image, make_tiny_qwen_image_edit
from triptych.families.qwenimage.tokenizer import train_qwen_tokenizer

TEST_CONDITION_AREA = 256 * 256
ORIGINAL_CALCULATE_DIMENSIONS = pipeline_qwenimage_edit.calculate_dimensions
# Batched vs alone, t2i and edit, per-branch and fused: latents measured 7.9e-7 max abs, decoded
# images 134.5 dB PSNR at worst (two runs); the bounds are 10x that / 20 dB under it.
BATCH_LATENT_TOL = 7e-6  # measured 7.9e-7 (two runs)
BATCH_MIN_PSNR = 115.0  # measured 134.5 dB (two runs)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def small_condition_area():
    small = lambda area, ratio: ORIGINAL_CALCULATE_DIMENSIONS(TEST_CONDITION_AREA, ratio)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_qwenimage_edit, "calculate_dimensions", small)
        yield


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    return {"t2i": make_tiny_qwen_image(root / "t2i", seed=0), "edit": make_tiny_qwen_image_edit(root / "edit", seed=0)}


@pytest.fixture(scope="module")
def t2i(model_dirs):
    return QwenImageFamily(model_dirs["t2i"])


@pytest.fixture(scope="module")
def edit(model_dirs):
    return QwenImageEditFamily(model_dirs["edit"])


def pristine_edit_pipeline(model_dir):
    return pristine_pipeline(model_dir, processor=load_processor(model_dir / "processor"))


@pytest.fixture(scope="module")
def pristine_t2i(model_dirs):
    return pristine_pipeline(model_dirs["t2i"])


@pytest.fixture(scope="module")
def pristine_edit(model_dirs):
    return pristine_edit_pipeline(model_dirs["edit"])


def condition_image(width=48, height=40):
    rng = np.random.RandomState(7)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


class ForwardCounter:
    """Counts transformer calls and the rows each one carried (a forward hook, removed on exit)."""

    def __init__(self, family):
        self.module = family.pipe.transformer
        self.rows: list[int] = []

    def __enter__(self):
        hook = lambda module, args, kwargs, out: self.rows.append(kwargs["hidden_states"].shape[0])  # noqa: E731
        self.handle = self.module.register_forward_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# ---- single request: bit-identical to diffusers ---------------------------------------------------
T2I_CASES = {
    "cfg-default-negative": dict(guidance=4.0, height=64, width=64),
    "cfg-negative-nonsquare": dict(guidance=3.0, negative_prompt="blurry, low quality", height=64, width=96),
    "no-cfg": dict(guidance=1.0, height=96, width=64),
}


@pytest.mark.parametrize("case", T2I_CASES)
def test_t2i_single_request_is_bit_identical_to_diffusers(t2i, pristine_t2i, case):
    p = t2i.resolve(GenerationParams(prompt="a red circle on a blue background", seed=3, steps=3, **T2I_CASES[case]))
    want = reference(pristine_t2i, p)
    state, frames = staged(t2i, p)
    assert len(state.branches()) == (1 if p.guidance <= 1 else 2)
    assert frames.array.shape == want.shape == (1, p.height, p.width, 3)
    assert np.abs(frames.array - want).max() == 0


EDIT_CASES = {
    "cfg-negative-nonsquare": dict(guidance=4.0, negative_prompt="blurry", height=64, width=96),
    "no-cfg": dict(guidance=1.0, height=64, width=64),
}


@pytest.mark.parametrize("case", EDIT_CASES)
def test_edit_single_request_is_bit_identical_to_diffusers(edit, pristine_edit, case):
    p = edit.resolve(
        GenerationParams(prompt="make the circle green", image=condition_image(), seed=5, steps=3, **EDIT_CASES[case])
    )
    want = reference(pristine_edit, p, image=p.image)
    state, frames = staged(edit, p)
    assert len(state.branches()) == (1 if p.guidance <= 1 else 2)
    height, width = condition_size(p.image)  # ~256² here; VAE ×8, then 2×2 patches
    assert state.cond.shared["image_latents"].shape[1] == (height // 16) * (width // 16) < 300
    assert frames.array.shape == want.shape == (1, p.height, p.width, 3)
    assert np.abs(frames.array - want).max() == 0


def test_edit_at_the_pipelines_real_condition_size(edit, pristine_edit, monkeypatch):
    """Unpatched: the condition image at the pipeline's ~1 MP (1024² area, VAE conv3d at full size)."""
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", ORIGINAL_CALCULATE_DIMENSIONS)
    p = edit.resolve(GenerationParams(prompt="make it blue", image=condition_image(), seed=1, steps=2, guidance=1.0))
    want = reference(pristine_edit, p, image=p.image)
    state, frames = staged(edit, p)
    assert state.cond.shared["image_latents"].shape[1] == (1120 // 16) * (928 // 16)  # 48:40 → 1120×928
    assert np.abs(frames.array - want).max() == 0


def test_edit_condition_area_from_the_models_triptych_json(model_dirs, tmp_path, monkeypatch):
    """A model may record the condition area it was trained at (the packaged default: 64×64); the
    family resizes the condition image (VAE latents and the VLM's prompt image) to that area.

    diffusers ignores ``triptych.json``: its pipeline hard-codes a 1024² area. The reference gets the
    64×64 area the way a diffusers user would: by setting the pipeline module's
    ``calculate_dimensions`` to one with that area, on a pipeline freshly loaded from the same copy."""
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", ORIGINAL_CALCULATE_DIMENSIONS)
    model = shutil.copytree(model_dirs["edit"], tmp_path / "edit")
    settings = json.loads((model / "triptych.json").read_text())
    (model / "triptych.json").write_text(json.dumps({**settings, "condition_area": 64 * 64}))
    family = QwenImageEditFamily(model)
    assert family.condition_area == 64 * 64
    image = condition_image(96, 96)
    p = family.resolve(GenerationParams(prompt="make it blue", image=image, seed=1, steps=2, guidance=1.0))
    state, frames = staged(family, p)
    assert state.cond.shared["image_latents"].shape[1] == (64 // 16) ** 2
    assert state.cond.shared["image_shape"].tolist() == [1, 4, 4]
    # Both the VAE latents and the VLM's prompt embeddings saw the 64×64 resize: handing the family
    # that resize (which it keeps as is) gives the same conditioning exactly.
    resized = family.pipe.image_processor.resize(image, 64, 64)
    again = family.encode(p.replace(image=resized))
    assert torch.equal(again.shared["image_latents"], state.cond.shared["image_latents"])
    assert torch.equal(again.branches["cond"]["prompt_embeds"], state.cond.branches["cond"]["prompt_embeds"])
    assert frames.array.shape == (1, p.height, p.width, 3)
    monkeypatch.setattr(
        pipeline_qwenimage_edit,
        "calculate_dimensions",
        lambda area, ratio: ORIGINAL_CALCULATE_DIMENSIONS(64 * 64, ratio),
    )
    want = reference(pristine_edit_pipeline(model), p, image=image)
    assert np.abs(frames.array - want).max() == 0


# ---- batching: one forward per CFG group, close to each request alone ------------------------------
def batch_requests(image):
    return [  # different prompts (token lengths), seeds, guidance, negative prompts, step counts
        GenerationParams(prompt="a red circle", image=image, seed=1, steps=4, guidance=4.0),
        GenerationParams(
            prompt="a large green square at the left on a black background",
            image=image,
            seed=2,
            steps=3,
            guidance=2.5,
            negative_prompt="low quality, blurry, distorted",
        ),
        GenerationParams(prompt="a yellow triangle at the top", image=image, seed=3, steps=2, guidance=1.0),
    ]


@pytest.mark.parametrize("fuse_cfg", [False, True], ids=["per-branch", "fused"])
@pytest.mark.parametrize("which", ["t2i", "edit"])
def test_batched_requests_match_each_alone(request, which, fuse_cfg):
    family = request.getfixturevalue(which)
    image = condition_image() if family.accepts_image else None
    params = [family.resolve(p) for p in batch_requests(image)]
    conds = [family.encode(p) for p in params]
    alone = []
    for i, (p, c) in enumerate(zip(params, conds)):
        s = family.prepare(f"alone-{i}", p, c)
        while not s.done:
            family.denoise_step([s])
        alone.append(s)
    states = [family.prepare(f"batch-{i}", p, c) for i, (p, c) in enumerate(zip(params, conds))]
    while not all(s.done for s in states):
        live = [s for s in states if not s.done]
        rows = sum(len(s.branches()) for s in live)
        groups = 1 if fuse_cfg else len({b for s in live for b in s.branches()})
        with ForwardCounter(family) as counter:
            stats = family.denoise_step(states, fuse_cfg=fuse_cfg)
        assert stats.forwards == len(counter.rows) == groups
        assert sum(counter.rows) == stats.rows == rows
    for s, a in zip(states, alone):
        assert s.step == a.step == s.params.steps
        latent_diff = (s.latents - a.latents).abs().max().item()
        assert latent_diff <= BATCH_LATENT_TOL, f"{s.request_id}: latents differ by {latent_diff:.2e}"
        quality = psnr(family.decode(s.latents, s.params).array, family.decode(a.latents, a.params).array)
        assert quality >= BATCH_MIN_PSNR, f"{s.request_id}: PSNR {quality:.1f} dB"


def test_first_step_of_a_batch_is_one_call_per_cfg_group(t2i):
    params = [t2i.resolve(p) for p in batch_requests(None)]
    states = [t2i.prepare(str(i), p, t2i.encode(p)) for i, p in enumerate(params)]
    with ForwardCounter(t2i) as counter:
        t2i.denoise_step(states)
    assert counter.rows == [3, 2]  # cond: all three requests; uncond: the two with guidance > 1
    with ForwardCounter(t2i) as counter:
        t2i.denoise_step(states, fuse_cfg=True)
    assert counter.rows == [5]


# ---- validation -----------------------------------------------------------------------------------
BAD = [
    ("t2i", dict(height=72), "height"),
    ("t2i", dict(width=0), "width"),
    ("t2i", dict(steps=0), "steps"),
    ("t2i", dict(steps=1), "steps"),  # Qwen-Image's shift_terminal makes a one-step schedule NaN
    ("t2i", dict(prompt="  "), "prompt"),
    ("t2i", dict(frames=2), "frames"),
    ("t2i", dict(guidance=0.5), "guidance"),
    ("t2i", dict(guidance=1.0, negative_prompt="blurry"), "negative_prompt"),
    ("t2i", dict(true_cfg=3.0), "true_cfg"),
    ("t2i", dict(image=condition_image()), "image"),
    ("edit", dict(image=None), "image"),
    ("edit", dict(image=np.zeros((8, 8, 3))), "image"),
    ("edit", dict(width=40), "width"),
]


@pytest.mark.parametrize("which,changes,field", BAD, ids=[f"{w}-{f}-{i}" for i, (w, _, f) in enumerate(BAD)])
def test_resolve_rejects_bad_params_naming_the_field(request, which, changes, field):
    family = request.getfixturevalue(which)
    base = dict(prompt="a red circle", image=condition_image() if which == "edit" else None)
    with pytest.raises(InvalidParam) as err:
        family.resolve(GenerationParams(**{**base, **changes}))
    assert err.value.field == field


def test_resolve_fills_model_defaults_and_default_negative_prompt(t2i):
    p = t2i.resolve(GenerationParams(prompt="a red circle"))
    assert (p.height, p.width, p.steps, p.guidance, p.frames) == (64, 64, 4, 4.0, 1)
    assert p.negative_prompt == DEFAULT_NEGATIVE_PROMPT and t2i.uses_cfg(p)
    assert t2i.resolve(GenerationParams(prompt="a red circle", guidance=1.0)).negative_prompt is None


# ---- loading --------------------------------------------------------------------------------------
def test_edit_split_across_role_instances_matches_one_process(model_dirs, edit):
    p = edit.resolve(GenerationParams(prompt="make it blue", image=condition_image(), seed=2, steps=2))
    encoder = QwenImageEditFamily(model_dirs["edit"], roles=[Role.ENCODER])
    denoiser = QwenImageEditFamily(model_dirs["edit"], roles=[Role.DENOISER])
    decoder = QwenImageEditFamily(model_dirs["edit"], roles=[Role.DECODER])
    assert denoiser.pipe.vae is None and denoiser.pipe.text_encoder is None and denoiser.pipe.processor is None
    assert encoder.pipe.transformer is None and encoder.pipe.vae is not None
    state = denoiser.prepare("r", p, encoder.encode(p))
    while not state.done:
        denoiser.denoise_step([state])
    split = decoder.decode(state.latents, p).array
    assert np.abs(split - staged(edit, p)[1].array).max() == 0


def test_edit_loads_a_checkpoint_whose_processor_needs_torchvision(model_dirs, edit, tmp_path):
    """A real Qwen-Image-Edit checkpoint declares transformers' Qwen2VLProcessor (not constructible
    without torchvision) and keeps the older processor layout: preprocessor + video configs."""
    real = shutil.copytree(model_dirs["edit"], tmp_path / "real")
    index = json.loads((real / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (real / "model_index.json").write_text(json.dumps(index))
    proc = real / "processor"
    image_cfg = json.loads((proc / "processor_config.json").read_text())["image_processor"]
    (proc / "processor_config.json").unlink()
    (proc / "preprocessor_config.json").write_text(json.dumps({**image_cfg, "processor_class": "Qwen2VLProcessor"}))
    video_cfg = {**image_cfg, "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"}
    (proc / "video_preprocessor_config.json").write_text(json.dumps(video_cfg))
    family = QwenImageEditFamily(real, roles=[Role.ENCODER])
    p = edit.resolve(GenerationParams(prompt="make it blue", image=condition_image(), steps=2, guidance=1.0))
    got, want = family.encode(p), edit.encode(p)
    assert torch.equal(got.branches["cond"]["prompt_embeds"], want.branches["cond"]["prompt_embeds"])
    assert torch.equal(got.shared["image_latents"], want.shared["image_latents"])


def test_tokenizer_template_prefixes_have_the_pipelines_drop_lengths():
    tok = train_qwen_tokenizer(extra_corpus=["a cyan hexagon below a magenta ring"])
    assert tok.convert_ids_to_tokens(tok("a cyan hexagon")["input_ids"]) == ["a", "Ġcyan", "Ġhexagon"]
    with pytest.raises(ValueError, match="drops 34"):
        train_qwen_tokenizer(vocab_size=300)  # too few merges: template words split into pieces


def test_mm_cache_runs_the_vision_tower_once_per_image_and_changes_nothing(model_dirs, edit):
    """The encoder's mm-hash cache: an edit with CFG encodes its image once (not once per branch), the
    same image again not at all, another image once; the conditioning is bit-identical to a family
    without the cache, and the cache stays within its byte budget."""
    from tests.helpers import count_calls
    from triptych.mmcache.cache import MMCacheConfig

    plain = QwenImageEditFamily(model_dirs["edit"], roles=(Role.ENCODER,), mm_cache_config=MMCacheConfig(max_mb=0))
    assert plain.mm_cache is None
    cached = QwenImageEditFamily(model_dirs["edit"], roles=(Role.ENCODER,))
    cache = cached.mm_cache
    tower = cached.pipe.text_encoder.model.visual.patch_embed  # the first layer: it runs only on a miss
    p = cached.resolve(
        GenerationParams(
            prompt="make the circle green",
            image=condition_image(),
            guidance=4.0,
            negative_prompt="blurry",
            height=64,
            width=64,
        )
    )
    other = p.replace(image=condition_image(40, 48), prompt="make it red")
    for params, runs in ((p, 1), (p.replace(prompt="make the square blue"), 0), (other, 1)):
        with count_calls(tower) as calls:
            got = cached.encode(params).flat()
        with count_calls(plain.pipe.text_encoder.model.visual.patch_embed) as plain_calls:
            want = plain.encode(params).flat()
        assert len(calls) == runs and len(plain_calls) == 2  # the plain path: once per CFG branch
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert (cache.stats.hits, cache.stats.misses, len(cache)) == (4, 2, 2)  # hits: 1 + 2 + 1
    assert 0 < cache.nbytes <= cache.max_bytes
    cache.max_bytes = cache.nbytes  # full: a third image evicts the least recently used one
    cached.encode(p.replace(image=condition_image(32, 32)))
    assert cache.stats.evictions >= 1 and cache.nbytes <= cache.max_bytes
