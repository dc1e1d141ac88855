"""``shapeworld.vocabulary``: the words the shipped shape-world models know, and the warning that
names a prompt's others. Every caption the models were trained on (each style, every scene and clip,
every edit instruction) has no unknown word, so a trained prompt is never warned of."""

from __future__ import annotations

import pytest

from shapeworld import caption, iter_all_scenes
from shapeworld.edits import TEMPLATES, edit_instruction
from shapeworld.video import clip_caption, iter_all_clips
from shapeworld.vocabulary import EDIT_WORDS, IMAGE_WORDS, VIDEO_WORDS, prompt_warning, unknown_words

STYLES = ("short", "long", "tag")


def test_every_trained_caption_and_instruction_is_inside_the_vocabulary():
    scenes = list(iter_all_scenes())
    assert not {w for s in scenes for style in STYLES for w in unknown_words(caption(s, style), IMAGE_WORDS)}
    clips = list(iter_all_clips())
    assert not {w for c in clips for style in STYLES for w in unknown_words(clip_caption(c, style), VIDEO_WORDS)}
    instructions = [
        edit_instruction(s, attribute, value, variant)
        for s in scenes[:20]
        for attribute, value in (("color", "red"), ("background", "green"), ("shape", "cross"), ("position", "top"))
        + (("size", "small"),)
        for variant in range(len(TEMPLATES[attribute]))
    ]
    assert not {w for text in instructions for w in unknown_words(text, EDIT_WORDS)}


@pytest.mark.parametrize(
    "prompt, words",
    [
        ("draw a blue triangle on a white background", ["draw"]),
        ("A Cat, a CAT and a dog!", ["cat", "dog"]),
        ("a purple plus at the center on a black canvas", []),  # synonyms the normaliser maps
    ],
)
def test_unknown_words_are_named_once_in_order(prompt, words):
    assert unknown_words(prompt, IMAGE_WORDS) == words


def test_the_warning_names_the_words_and_suggests_the_known_caption():
    note = prompt_warning("default", "shapes", "draw a blue triangle on a white background")
    assert note.startswith("model 'default' does not know the word 'draw':"), note
    assert note.endswith("try 'a blue triangle on a white background'"), note
    assert "words 'cat', 'jumping'" in prompt_warning("video", "shapes-video", "a cat jumping")
    assert "try" not in prompt_warning("video", "shapes-video", "a cat jumping")  # no shape named: nothing to try
    assert prompt_warning("default", "shapes", "a red circle moving rightwards on a blue background") is not None
    assert prompt_warning("video", "shapes-video", "a red circle moving rightwards on a blue background") is None
    assert prompt_warning("default", "shapes", "turn the circle into a square", edit=True) is None
    assert prompt_warning("default", "shapes", "turn the circle into a cat", edit=True) is not None
    assert prompt_warning("flux", None, "a cat") is None  # a user's model: any words
