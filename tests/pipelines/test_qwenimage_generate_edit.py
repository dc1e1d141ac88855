"""One Qwen-Image checkpoint that generates and edits (``families.qwenimage.generate_edit``): the
packaged default, whose ``triptych.json`` says ``"edits": true``.

Exactness is against diffusers' own pipelines loaded afresh in the test: ``QwenImagePipeline`` from
``assets/default`` for a request without an image, ``QwenImageEditPipeline`` from
``assets/default_edit`` (the same weights, linked) for an edit. The edit pipeline resizes condition
images to a hard-coded ~1 MP; the packaged model was trained at 64×64 (its ``condition_area``), so
the module's ``calculate_dimensions`` is patched to that area for both sides, as in test_qwenimage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

from tests.helpers import pristine_pipeline, staged
from tests.helpers import qwen_reference as reference
from triptych.core.errors import InvalidParam
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import GenerationParams, Role
from triptych.families.models import PACKAGED_DEFAULT, PACKAGED_EDIT
from triptych.families.qwenimage.generate_edit import QwenImageGenerateEditFamily
from triptych.families.qwenimage.processor import load_processor
from triptych.families.registry import load_family

pytestmark = pytest.mark.skipif(
    not (PACKAGED_DEFAULT / "model_index.json").is_file(), reason="no trained default model shipped"
)
AREA = 64 * 64  # the packaged model's condition_area
ORIGINAL = pipeline_qwenimage_edit.calculate_dimensions


@pytest.fixture(scope="module", autouse=True)
def one_thread_and_trained_area():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: ORIGINAL(AREA, ratio))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def family():
    return load_family(PACKAGED_DEFAULT)


def condition_image():
    from shapeworld import render, sample_scenes

    return render(sample_scenes(1, "generate-edit", "heldout")[0], 64)


def test_the_default_loads_as_one_family_that_generates_and_edits(family):
    assert isinstance(family, QwenImageGenerateEditFamily)
    assert family.accepts_image and not family.requires_image and family.condition_area == AREA


def test_a_request_without_an_image_is_bit_identical_to_qwen_image_pipeline(family):
    p = family.resolve(GenerationParams(prompt="a red circle on a white background", seed=3, steps=4))
    want = reference(pristine_pipeline(PACKAGED_DEFAULT), p, max_sequence_length=512)
    state, frames = staged(family, p)
    assert "image_latents" not in state.cond.shared and len(state.branches()) == 2
    assert frames.array.shape == want.shape == (1, 64, 64, 3)
    assert np.abs(frames.array - want).max() == 0


def test_an_edit_is_bit_identical_to_qwen_image_edit_pipeline(family):
    pristine = pristine_pipeline(PACKAGED_EDIT, processor=load_processor(PACKAGED_EDIT / "processor"))
    p = family.resolve(GenerationParams(prompt="make the shape blue", image=condition_image(), seed=5, steps=4))
    want = reference(pristine, p, image=p.image)
    state, frames = staged(family, p)
    assert state.cond.shared["image_latents"].shape[1] == 16  # 64x64 condition: 4x4 patches of 2x2 latents
    assert frames.array.shape == want.shape == (1, 64, 64, 3)
    assert np.abs(frames.array - want).max() == 0


def test_each_role_loads_its_weights_once(monkeypatch):
    """Both pipelines of an instance hold the same modules: each component of a role is read from
    disk once (counted at diffusers' loader), not once per job."""
    from diffusers.pipelines import pipeline_utils

    loaded = []
    real = pipeline_utils.load_sub_model

    def counting(*args, **kwargs):
        loaded.append(kwargs["name"])
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_utils, "load_sub_model", counting)  # the name from_pretrained calls
    fam = load_family(PACKAGED_DEFAULT, roles=(Role.ENCODER,))
    assert sorted(loaded) == ["scheduler", "text_encoder", "tokenizer", "vae"]
    assert fam.t2i_pipe.text_encoder is fam.pipe.text_encoder and fam.t2i_pipe.vae is fam.pipe.vae


def test_generations_and_edits_never_share_a_forward_and_each_equals_its_run_alone(family):
    """Stepped together by the batching engine, a generation and an edit of the same size run in
    separate transformer calls (an edit's rows carry its condition image's tokens) and each ends
    exactly where it ends alone (both CFG branches in one call, as the engine runs a request)."""
    params = {
        "gen": family.resolve(GenerationParams(prompt="a blue square on a black background", seed=1, steps=3)),
        "edit": family.resolve(GenerationParams(prompt="make the shape red", image=condition_image(), seed=2, steps=3)),
    }
    alone = {rid: staged(family, p, fuse_cfg=True)[0].latents for rid, p in params.items()}
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=4))
    states = {rid: family.prepare(rid, p, family.encode(p)) for rid, p in params.items()}
    for state in states.values():
        engine.add(state)
    rows = []
    handle = family.pipe.transformer.register_forward_hook(
        lambda m, a, kw, out: rows.append(kw["hidden_states"].shape[1]), with_kwargs=True
    )
    try:
        while engine.has_work():
            engine.step()
    finally:
        handle.remove()
    assert sorted(set(rows)) == [16, 32]  # noise tokens only; noise + the condition image's 16
    for rid, state in states.items():
        assert torch.equal(state.latents, alone[rid]), rid


def test_an_edit_asking_for_teacache_is_refused_naming_the_field(family):
    p = GenerationParams(prompt="make the shape red", image=condition_image(), seed=2, teacache_threshold=0.1)
    with pytest.raises(InvalidParam) as e:
        family.resolve(p)
    assert e.value.field == "teacache_threshold" and "text-to-image only" in str(e.value)
