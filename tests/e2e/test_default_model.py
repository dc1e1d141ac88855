"""The shipped default model (triptych/assets/default) draws what it is asked, read back from pixels."""

from __future__ import annotations

import pytest

from triptych.models import PACKAGED_DEFAULT, default_model_dir

pytestmark = pytest.mark.skipif(
    not (PACKAGED_DEFAULT / "model_index.json").is_file(), reason="no trained default model shipped"
)


@pytest.fixture(scope="module")
def family():
    import torch

    from triptych.pipelines.registry import load_family

    torch.set_num_threads(1)
    return load_family(PACKAGED_DEFAULT)


def test_default_is_the_packaged_model():
    assert default_model_dir() == PACKAGED_DEFAULT
    assert (PACKAGED_DEFAULT / "MODEL_CARD.md").is_file()


# Held-out combinations (never in training); indices into evaluate's 50 held-out prompts.
HELDOUT = [0, 1, 2]


@pytest.mark.parametrize("index", HELDOUT)
def test_heldout_prompt_draws_the_scene(family, index):
    from triptych.pipelines.base import GenerationParams
    from triptych.pipelines.runner import run_request
    from triptych.world import caption, sample_scenes, score

    scene = sample_scenes(50, "eval", "heldout")[index]
    assert scene.split == "heldout"
    frames, _ = run_request(family, GenerationParams(prompt=caption(scene, "short"), seed=index))
    result = score(frames.to_uint8()[0], scene)
    assert (result["shape"], result["color"], result["background"]) == (True, True, True), (scene, result)
