"""The default chat model answers in both part orders.

Clients put a user message's image before or after its text (OpenAI's examples: text first). The
shipped captioner was trained on image-then-question only, and asked question-then-image it named
the shape of 36 of the card's 50 held-out images (41 image first). Its weights are the image
generator's text encoder, so they are not retrained: the shipped default's ``triptych.json`` says
``"chat_parts": "image-first"`` and its ``ChatModel`` moves a user message's images before its
text. Asked through the chat path (``ChatModel``, as ``/v1/chat/completions`` and ``triptych chat``
ask) about those 50 images it names shape and colour of at least the stated 80% in each order; a
user's model gets its parts in the order sent; and the text encoder is still the one the generator
was trained on (its hash is MODEL_CARD.md's).
"""

from __future__ import annotations

import hashlib

import pytest

from triptych.families.models import PACKAGED_DEFAULT

pytestmark = pytest.mark.skipif(
    not (PACKAGED_DEFAULT / "model_index.json").is_file(), reason="no trained default model shipped"
)

#: MODEL_CARD.md's SHA-256 of the shipped text encoder (unchanged: the generator reads it).
TEXT_ENCODER_SHA256 = "7bad76a915922f951f8ec0087fc02aab8824313915c39505a83e63a83781c802"
CAPTION_SCENES = 50  # MODEL_CARD.md's 50 held-out images (seed "eval-captions")
RIGHT_AT_LEAST = 40  # the stated 80%; measured: see MODEL_CARD.md (image first / text first)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def family():
    from triptych.families.registry import load_family

    return load_family(PACKAGED_DEFAULT)


def test_the_text_encoder_is_the_one_the_generator_was_trained_on():
    digest = hashlib.sha256((PACKAGED_DEFAULT / "text_encoder" / "model.safetensors").read_bytes())
    assert digest.hexdigest() == TEXT_ENCODER_SHA256


def test_only_the_shipped_captioner_reorders_and_only_user_messages(family, tiny_model_dir):
    from triptych.chat import ChatParams, ChatTurn
    from triptych.families.registry import load_family

    params = ChatParams(
        turns=(ChatTurn("user", ("first", 0, "second", 1)), ChatTurn("assistant", ("ok",)), ChatTurn("user", ("q", 1))),
        images=(None, None),
    )
    assert family.chat_model().ordered(params) == (
        ChatTurn("user", (0, 1, "first", "second")),
        ChatTurn("assistant", ("ok",)),
        ChatTurn("user", (1, "q")),
    )
    users = load_family(tiny_model_dir("qwen-image-edit")).chat_model()
    assert users is not None and users.ordered(params) == params.turns


@pytest.mark.parametrize("order", ["image-first", "text-first"])
def test_captioner_names_shape_and_colour_in_both_orders(family, order):
    from shapeworld import render, sample_scenes, score_caption
    from training.common import CAPTION_QUESTION
    from triptych.chat import ChatParams, ChatTurn

    chat = family.chat_model()
    parts = (0, CAPTION_QUESTION) if order == "image-first" else (CAPTION_QUESTION, 0)
    scenes = sample_scenes(CAPTION_SCENES, "eval-captions", "heldout")
    wrong = []
    for scene in scenes:
        params = ChatParams(turns=(ChatTurn("user", parts),), images=(render(scene, 64),), max_tokens=24)
        answer = chat.run(params).text
        if not all(score_caption(answer, scene)[k] for k in ("shape", "color")):
            wrong.append((scene, answer))
    assert CAPTION_SCENES - len(wrong) >= RIGHT_AT_LEAST, wrong
