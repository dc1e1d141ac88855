"""The words the shipped shape-world models know, and a warning naming the ones a prompt has beyond them.

The models were trained on the world's captions only (``shapeworld.prompts``' module docstring): a
prompt with another word ("draw a blue triangle on a white background") is passed to the text
encoder unchanged, and the model draws something else, often a blank field. ``unknown_words`` finds
those words; ``prompt_warning`` is the one line the command line and the server show for them, with
the prompt's known words as the caption to try where they name a shape.
"""

from __future__ import annotations

import re

from shapeworld.captions import (
    BACKGROUND_WORDS,
    COLOR_WORDS,
    GENERIC_SHAPE_WORDS,
    POSITION_WORDS,
    SHAPE_WORDS,
    SIZE_WORDS,
)
from shapeworld.edits import TEMPLATES
from shapeworld.prompts import DIRECTION_PHRASES, FILLER, normaliser

_WORD = re.compile(r"[a-z]+|\+")  # the normaliser's own tokens (``shapeworld.prompts``)

IMAGE_WORDS = frozenset(
    FILLER
    | SHAPE_WORDS.keys()
    | GENERIC_SHAPE_WORDS
    | COLOR_WORDS.keys()
    | POSITION_WORDS.keys()
    | SIZE_WORDS.keys()
    | BACKGROUND_WORDS
    | {"color"}
)
VIDEO_WORDS = IMAGE_WORDS | {w for phrases in DIRECTION_PHRASES.values() for p in phrases for w in p.split()}
EDIT_WORDS = IMAGE_WORDS | {w for ts in TEMPLATES.values() for t in ts for w in _WORD.findall(t) if "{" not in w}
#: ``triptych.json`` ``"prompt_normaliser"`` -> (words of its prompts, words of its edit instructions)
VOCABULARIES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "shapes": (IMAGE_WORDS, EDIT_WORDS),
    "shapes-video": (VIDEO_WORDS, VIDEO_WORDS),
}


def _tokens(prompt: str) -> list[str]:
    return _WORD.findall(prompt.lower().replace("colour", "color"))


def unknown_words(prompt: str, vocabulary: frozenset[str]) -> list[str]:
    """The prompt's words outside ``vocabulary``, each once, in order (case and punctuation ignored)."""
    return list(dict.fromkeys(w for w in _tokens(prompt) if w not in vocabulary))


def prompt_warning(model: str, normaliser_name: str | None, prompt: str, edit: bool = False) -> str | None:
    """One line naming the words of ``prompt`` that the model (its ``triptych.json``'s
    ``prompt_normaliser``) does not know; None when it knows them all or has no vocabulary."""
    if normaliser_name not in VOCABULARIES or not isinstance(prompt, str):
        return None
    vocabulary = VOCABULARIES[normaliser_name][1 if edit else 0]
    unknown = unknown_words(prompt, vocabulary)
    if not unknown:
        return None
    words = ", ".join(repr(w) for w in unknown)
    line = (
        f"model {model!r} does not know the word{'s' if len(unknown) > 1 else ''} {words}: it was trained on "
        "shape-world captions only (e.g. 'a red circle on a blue background'), so it may draw something else "
        "(often a blank image)"
    )
    known = [w for w in _tokens(prompt) if w in vocabulary]
    if not edit and any(w in SHAPE_WORDS for w in known):
        line += f"; try {normaliser(normaliser_name)(' '.join(known), False)!r}"
    return line
