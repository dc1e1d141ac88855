"""The shipped shape-world models normalise prompts before their text encoder; no other model does.

A paraphrase and its canonical caption reach the text encoder as the same token ids (captured at
the pipeline's ``encode_prompt``), and for a few the scorer reads the intended attributes back
from what the model drew (the video model's "from left to right": the wrong shape and direction
before normalisation). A tiny seeded Qwen-Image model (a user's model: no ``prompt_normaliser`` in
its ``triptych.json``) gets the prompt exactly as sent.
"""

from __future__ import annotations

import pytest

from triptych.families.models import PACKAGED_DEFAULT, PACKAGED_VIDEO

pytestmark = pytest.mark.skipif(
    not (PACKAGED_DEFAULT / "model_index.json").is_file() or not (PACKAGED_VIDEO / "model_index.json").is_file(),
    reason="no trained default models shipped",
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _encoder_inputs(family, prompt, image=None):
    """The token ids of every prompt the family's pipelines hand their text encoder for one encode."""
    from triptych.families.base import GenerationParams

    seen: list[str] = []
    pipes = [family.pipe] + ([family.t2i_pipe] if hasattr(family, "t2i_pipe") else [])
    originals = [p.encode_prompt for p in pipes]
    for pipe, original in zip(pipes, originals):

        def spy(*args, _original=original, **kwargs):
            seen.append(kwargs["prompt"])
            return _original(*args, **kwargs)

        pipe.encode_prompt = spy
    try:
        family.encode(family.resolve(GenerationParams(prompt=prompt, image=image, guidance=1.0)))
    finally:
        for pipe in pipes:
            del pipe.encode_prompt
    return [family.pipe.tokenizer(p)["input_ids"] for p in seen]


IMAGE_PAIRS = [
    (
        "a small white cross on a magenta background at the left",
        "a small white cross at the left on a magenta background",
    ),
    (
        "a red circle on a blue background, large, in the middle",
        "a large red circle in the centre on a blue background",
    ),
    ("purple plus on a white background", "a magenta cross on a white background"),
]
VIDEO_PAIRS = [
    (
        "a red circle moving from left to right on a blue background",
        "a red circle moving rightwards on a blue background",
    ),
    ("a green square going down on a white background", "a green square moving downwards on a white background"),
]


@pytest.fixture(scope="module")
def image_family():
    from triptych.families.registry import load_family

    return load_family(PACKAGED_DEFAULT)


@pytest.fixture(scope="module")
def video_family():
    from triptych.families.registry import load_family

    return load_family(PACKAGED_VIDEO)


@pytest.mark.parametrize(("paraphrase", "canonical"), IMAGE_PAIRS)
def test_image_paraphrase_reaches_the_encoder_as_the_canonical_caption(image_family, paraphrase, canonical):
    ids = _encoder_inputs(image_family, paraphrase)
    assert ids and ids == _encoder_inputs(image_family, canonical)


@pytest.mark.parametrize(("paraphrase", "canonical"), VIDEO_PAIRS)
def test_video_paraphrase_reaches_the_encoder_as_the_canonical_caption(video_family, paraphrase, canonical):
    ids = _encoder_inputs(video_family, paraphrase)
    assert ids and ids == _encoder_inputs(video_family, canonical)


def test_edit_synonyms_reach_the_encoder_as_the_trained_words(image_family):
    from shapeworld import Scene, render

    image = render(Scene("circle", "red", "blue", "centre", "large"), 64)
    assert _encoder_inputs(image_family, "make the circle purple", image) == _encoder_inputs(
        image_family, "make the circle magenta", image
    )


def test_a_users_model_gets_the_prompt_as_sent(tiny_model_dir):
    from triptych.families.registry import load_family

    family = load_family(tiny_model_dir("qwen-image"))
    assert family.prompt_normaliser is None
    paraphrase, canonical = IMAGE_PAIRS[0]
    assert _encoder_inputs(family, paraphrase) != _encoder_inputs(family, canonical)


def test_paraphrases_draw_what_they_say(image_family, video_family):
    """Read back from pixels: two image paraphrases (held-out seeds 0, 1) and the issue's video one."""
    from shapeworld import Scene, score
    from shapeworld.video import Clip
    from shapeworld.video_scorer import score_clip
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams

    scenes = [Scene("cross", "white", "magenta", "left", "small"), Scene("circle", "red", "blue", "centre", "large")]
    for seed, ((paraphrase, _), scene) in enumerate(zip(IMAGE_PAIRS, scenes)):
        frames, _ = run_request(image_family, GenerationParams(prompt=paraphrase, seed=seed))
        assert all(score(frames.to_uint8()[0], scene).values()), (paraphrase, score(frames.to_uint8()[0], scene))
    frames, _ = run_request(video_family, GenerationParams(prompt=VIDEO_PAIRS[0][0], seed=0))
    r = score_clip(frames.to_uint8(), Clip("circle", "red", "blue", "rightwards", "large"))
    assert r["direction"] and min(r["shape"], r["color"], r["background"]) >= 0.8, r
