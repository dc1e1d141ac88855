"""The VLM path on the packaged default model: ``ChatModel`` over the encoder's own Qwen2.5-VL.

It answers about images through the chat template, streams pieces that add up to the answer, stops
at ``max_tokens`` or on cancel, samples reproducibly from a seed, refuses prompts past the model's
context, and shares the encoder's mm-hash cache with edit encodes of the same image."""

from __future__ import annotations

import pytest
import torch

from shapeworld import render, sample_scenes, score_caption
from triptych.chat import ChatParams, ChatTurn
from triptych.core.errors import InvalidParam
from triptych.families.base import GenerationParams, Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class
from triptych.mmcache.cache import MMCacheConfig

EDIT_MODEL = PACKAGED_DEFAULT.parent / "default_edit"
QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def family():
    torch.set_num_threads(1)
    path = EDIT_MODEL
    return family_class(path)(path, roles={Role.ENCODER})


def ask(*images, question: str = QUESTION, **kw) -> ChatParams:
    return ChatParams((ChatTurn("user", (*range(len(images)), question)),), tuple(images), **kw)


def test_both_default_models_chat_and_the_edit_one_answers_about_heldout_images(family):
    t2i = family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER})
    assert t2i.supports_chat and t2i.chat_model() is not None  # the text-to-image model ships the processor too
    chat = family.chat_model()
    scenes = sample_scenes(6, "chat-test", "heldout")
    right = 0
    for scene in scenes:
        result = chat.run(ask(render(scene, 64)))
        score = score_caption(result.text, scene)
        right += score["shape"] and score["color"]
        assert score["color"], (scene, result.text)  # colour: 100% on the captioner's held-out evaluation
        assert result.finish_reason == "stop" and result.completion_tokens > 3
    assert right >= 4, right  # shape and colour: 82% on the 50 held-out images of the model card


def test_streamed_pieces_add_up_to_the_answer_and_max_tokens_stops_it(family):
    chat = family.chat_model()
    image = render(sample_scenes(1, "chat-test", "heldout")[0], 64)
    got: list[str] = []
    full = chat.run(ask(image), on_text=got.append)
    assert "".join(got) == full.text and len(got) > 3
    short = chat.run(ask(image, max_tokens=3))
    assert short.finish_reason == "length" and short.completion_tokens == 3
    assert full.text.startswith(short.text) and short.prompt_tokens == full.prompt_tokens


def test_cancel_stops_generation_at_the_next_token(family):
    chat = family.chat_model()
    seen: list[str] = []
    result = chat.run(
        ask(render(sample_scenes(1, "chat-test", "heldout")[0], 64)),
        on_text=seen.append,
        should_stop=lambda: len(seen) >= 2,
    )
    assert result.finish_reason == "cancelled" and result.completion_tokens <= 4


def test_sampling_is_reproducible_from_the_seed(family):
    chat = family.chat_model()
    # Without an image the captioner is unsure of every word, so sampling shows (with one it is not).
    answers = [chat.run(ask(question="hello", temperature=2.0, seed=s, max_tokens=8)).text for s in range(4)]
    again = [chat.run(ask(question="hello", temperature=2.0, seed=s, max_tokens=8)).text for s in range(4)]
    assert answers == again
    assert len(set(answers)) > 1  # it does sample (greedy would give one answer)


def test_a_vanishing_temperature_is_greedy_not_an_overflow(family):
    """temperature 5e-324 (what the schema fuzzer sent) used to overflow the logits and raise in sampling."""
    chat = family.chat_model()
    greedy = chat.run(ask(question="hello", temperature=0.0, max_tokens=6)).text
    assert chat.run(ask(question="hello", temperature=5e-324, max_tokens=6)).text == greedy


def test_prompt_past_the_context_is_refused_naming_max_tokens(family):
    chat = family.chat_model()
    with pytest.raises(InvalidParam) as e:
        chat.run(ask(question="hi", max_tokens=chat.context))
    assert e.value.field == "max_tokens" and str(chat.context) in e.value.rule


@pytest.mark.parametrize(
    "params, field",
    [
        (ChatParams(()), "messages"),
        (ChatParams((ChatTurn("robot", ("hi",)),)), "messages[0].role"),
        (ChatParams((ChatTurn("user", ("hi",)), ChatTurn("assistant", ("yo",)))), "messages[1].role"),
        (ChatParams((ChatTurn("user", (3, "hi")),)), "messages[0].content"),
        (ChatParams((ChatTurn("user", ("hi",)),), max_tokens=0), "max_tokens"),
        (ChatParams((ChatTurn("user", ("hi",)),), temperature=3.0), "temperature"),
        (ChatParams((ChatTurn("user", ("hi",)),), top_p=0.0), "top_p"),
    ],
)
def test_structural_checks_name_the_field(params, field):
    with pytest.raises(InvalidParam) as e:
        params.check(max_images=2)
    assert e.value.field == field


def test_chat_and_edit_share_the_encoders_mm_cache_entry(family):
    """The same image, seen by an edit encode and then by chat, runs the vision tower once (and the
    edit embeddings are the same with the cache as without it)."""
    image = render(sample_scenes(1, "chat-cache-test", "heldout")[0], 64)  # an image no other test shows
    stats = family.mm_cache.stats
    params = family.resolve(GenerationParams(prompt="make the shape red", image=image, seed=0))
    misses = stats.misses
    cond = family.encode(params)
    assert stats.misses == misses + 1  # CFG's second branch hit the entry the first one made
    hits = stats.hits
    family.chat_model().run(ask(image, max_tokens=4))
    assert stats.hits == hits + 1 and stats.misses == misses + 1
    plain = family_class(EDIT_MODEL)(EDIT_MODEL, roles={Role.ENCODER}, mm_cache_config=MMCacheConfig(max_mb=0))
    assert plain.mm_cache is None
    fresh = plain.encode(params)
    for name, tensor in cond.flat().items():
        torch.testing.assert_close(fresh.flat()[name], tensor, rtol=0, atol=0)


def test_tiny_models_chat_and_a_processor_without_a_template_does_not(tiny_model_dir, tmp_path):
    import shutil

    tiny = tiny_model_dir("qwen-image-edit")
    fam = family_class(tiny)(tiny, roles={Role.ENCODER})
    assert fam.supports_chat
    result = fam.chat_model().run(ask(render(sample_scenes(1, "chat-test", "heldout")[0], 64), max_tokens=3))
    assert result.completion_tokens == 3 and result.prompt_tokens > 16  # random weights: words, not sense
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    (bare / "processor" / "chat_template.jinja").unlink()
    config = bare / "processor" / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    assert not family_class(bare)(bare, roles=()).supports_chat
    assert family_class(bare)(bare, roles={Role.ENCODER}).chat_model() is None  # registers without chat
