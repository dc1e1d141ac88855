"""The shipped default model (triptych/assets/default), read back from pixels with the world scorer.

Held-out scenes only (combinations never seen in training), fixed seeds, so results are exact on CPU.
What is asserted is what the shipped weights do (see MODEL_CARD.md): text-to-image draws the
requested background colour (98% of 50 held-out prompts; shape colour/kind are not yet reliable),
and the Qwen2.5-VL captioner, asked through its chat template, names shape and colour (84%).
"""

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


def test_default_is_the_packaged_qwen_image_model():
    from triptych.pipelines.registry import architecture

    assert default_model_dir() == PACKAGED_DEFAULT
    assert architecture(PACKAGED_DEFAULT) == "QwenImagePipeline"
    assert (PACKAGED_DEFAULT / "MODEL_CARD.md").is_file()


@pytest.mark.parametrize("index", [0, 1, 3])  # indices into evaluate's 50 held-out prompts
def test_heldout_prompt_draws_the_background(family, index):
    from triptych.pipelines.base import GenerationParams
    from triptych.pipelines.runner import run_request
    from triptych.world import caption, sample_scenes, score

    scene = sample_scenes(50, "eval", "heldout")[index]
    assert scene.split == "heldout"
    frames, _ = run_request(family, GenerationParams(prompt=caption(scene, "short"), seed=index))
    assert frames.array.shape == (1, 64, 64, 3)
    result = score(frames.to_uint8()[0], scene)
    assert result["background"], (scene, result)


def test_captioner_names_shape_and_colour_of_heldout_images():
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from triptych.training import build
    from triptych.training.train_vlm import caption_images
    from triptych.world import render, sample_scenes, score_caption

    torch.set_num_threads(1)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(PACKAGED_DEFAULT / "text_encoder").eval()
    processor = build.processor(AutoTokenizer.from_pretrained(PACKAGED_DEFAULT / "tokenizer"))
    scenes = [sample_scenes(50, "eval-captions", "heldout")[i] for i in (0, 1, 3)]
    for scene, answer in zip(scenes, caption_images(model, processor, [render(s, 64) for s in scenes])):
        result = score_caption(answer, scene)
        assert result["shape"] and result["color"], (scene, answer)
