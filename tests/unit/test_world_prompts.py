"""``shapeworld.prompts``: paraphrases of the shape world's vocabulary -> the trained captions.

Pure functions, no model. Every canonical caption (each style, every scene and clip) is its own
normal form, so the shipped models get exactly what they were trained on; a paraphrase gets the
canonical caption; a prompt with a word outside the vocabulary, or an attribute missing, is left
alone. The encoder-level check (the same token ids reach the text encoder) is
``tests/e2e/test_prompt_normaliser.py``.
"""

from __future__ import annotations

import pytest

from shapeworld import caption, iter_all_scenes
from shapeworld.prompts import (
    normalise_edit_prompt,
    normalise_image_prompt,
    normalise_video_prompt,
    normaliser,
)
from shapeworld.video import clip_caption, iter_all_clips

IMAGE_PAIRS = [
    (
        "a small white cross on a magenta background at the left",
        "a small white cross at the left on a magenta background",
    ),
    (
        "a small white cross on the left on a magenta background",
        "a small white cross at the left on a magenta background",
    ),
    (
        "a red circle on a blue background, small, on the left side",
        "a small red circle at the left on a blue background",
    ),
    (
        "a large blue square in the center on a yellow background",
        "a large blue square in the centre on a yellow background",
    ),
    ("a big green triangle at the top on a black backdrop", "a large green triangle at the top on a black background"),
    ("purple plus on a white background", "a magenta cross on a white background"),
    ("the background is blue, with a red circle", "a red circle on a blue background"),
    ("a red circle on blue background", "a red circle on a blue background"),
]
VIDEO_PAIRS = [
    (
        "a red circle moving from left to right on a blue background",
        "a red circle moving rightwards on a blue background",
    ),
    ("a red circle moving to the right on a blue background", "a red circle moving rightwards on a blue background"),
    ("a red circle on a blue background moving right", "a red circle moving rightwards on a blue background"),
    (
        "a green square going from right to left on a white background",
        "a green square moving leftwards on a white background",
    ),
    (
        "a small yellow triangle moving down on a black background",
        "a small yellow triangle moving downwards on a black background",
    ),
    ("a cyan cross moving from bottom to top on a red background", "a cyan cross moving upwards on a red background"),
]
UNCHANGED = [
    "a green square",  # no background: the model was never asked for one without
    "a red circle on a blue background, photorealistic",  # a word outside the vocabulary
    "a red circle on a red background",  # shape and background the same colour
    "a small red circle on a blue background",  # size without position: no trained caption has that
    "a red circle and a blue square on a green background",
    "",
]


@pytest.mark.parametrize(("paraphrase", "canonical"), IMAGE_PAIRS)
def test_image_paraphrases_become_the_trained_caption(paraphrase, canonical):
    assert normalise_image_prompt(paraphrase) == canonical
    assert normalise_image_prompt(canonical) == canonical


@pytest.mark.parametrize(("paraphrase", "canonical"), VIDEO_PAIRS)
def test_video_paraphrases_become_the_trained_clip_caption(paraphrase, canonical):
    assert normalise_video_prompt(paraphrase) == canonical


@pytest.mark.parametrize("prompt", UNCHANGED)
def test_prompts_outside_the_vocabulary_pass_unchanged(prompt):
    assert normalise_image_prompt(prompt) == prompt
    assert normalise_video_prompt(prompt) == prompt


def test_every_trained_caption_is_its_own_normal_form():
    """All 2,240 scenes x 3 styles and all 3,584 clips x 3 styles: the models see exactly their captions."""
    for scene in iter_all_scenes("all"):
        for style in ("short", "long", "tag"):
            text = caption(scene, style)
            assert normalise_image_prompt(text) == text
    for clip in iter_all_clips("all"):
        for style in ("short", "long", "tag"):
            text = clip_caption(clip, style)
            assert normalise_video_prompt(text) == text


def test_edit_instructions_get_word_synonyms_only():
    assert normalise_edit_prompt("make the circle purple") == "make the circle magenta"
    assert normalise_edit_prompt("move the plus to the center") == "move the cross to the centre"
    assert normalise_edit_prompt("make the circle larger") == "make the circle bigger"
    assert normalise_edit_prompt("make the circle green") == "make the circle green"


def test_normaliser_names():
    assert normaliser(None) is None
    assert normaliser("shapes")("a red circle on blue background", False) == "a red circle on a blue background"
    assert normaliser("shapes")("make it purple", True) == "make it magenta"
    assert normaliser("shapes-video")("a red circle moving right on a blue background", False).endswith(
        "rightwards on a blue background"
    )
    with pytest.raises(ValueError, match="prompt_normaliser"):
        normaliser("nope")


def test_random_word_soups_never_raise_and_give_a_trained_caption_or_the_prompt():
    """10,000 seeded shuffles of a red circle, a blue background, filler and direction words: each comes back unchanged or
    as a caption the models were trained on (checked against every scene's and clip's captions)."""
    import random

    from shapeworld.prompts import DIRECTION_PHRASES, FILLER

    words = sorted(FILLER) + ["red", "blue", "purple", "circle", "plus", "background", "left", "right", "small", "big"]
    words += [p for phrases in DIRECTION_PHRASES.values() for p in phrases] + ["photorealistic", ",", "+"]
    images = {caption(s, st) for s in iter_all_scenes("all") for st in ("short", "long")}
    clips = {clip_caption(c, st) for c in iter_all_clips("all") for st in ("short", "long")}
    rng = random.Random(0)
    rewritten = 0
    for _ in range(10_000):
        soup = [rng.choice(words) for _ in range(rng.randint(0, 4))] + ["circle", "red", "blue", "background"]
        rng.shuffle(soup)
        prompt = " ".join(soup[: rng.randint(0, len(soup))] if rng.random() < 0.3 else soup)
        rewritten += normalise_image_prompt(prompt) != prompt or normalise_video_prompt(prompt) != prompt
        assert normalise_image_prompt(prompt) == prompt or normalise_image_prompt(prompt) in images
        assert normalise_video_prompt(prompt) == prompt or normalise_video_prompt(prompt) in clips
    assert rewritten > 1000  # measured: 5,337 of the 10,000 rewritten
