"""The chat engine's vision thread (``ChatEngineConfig.vision_thread``) on the packaged default
model: a chat's images run through the tower on a thread of their own while the engine's steps
go on. Ordering is checked by events (a tower call held until the test lets it go), not by
clocks: the stream decodes while the call is in flight, the chat waits for its embeddings, and
the answers are those of each chat alone."""

from __future__ import annotations

import threading

import pytest
import torch

from shapeworld import render, sample_scenes
from tests.helpers import FixedCosts as Fixed
from triptych.chat import ChatParams, ChatTurn
from triptych.chat import tower as tower_module
from triptych.chat.config import ChatEngineConfig
from triptych.chat.engine import ChatEngine
from triptych.chat.prompt import build_prompt, chunk_embeddings
from triptych.families.base import Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class

SPLIT = {"decode": 1.0, "vision": 0.02, "prefill": 0.005}
THREAD = ChatEngineConfig(vision_thread=True, prefix_cache_mb=0)


@pytest.fixture(scope="module")
def chat():
    return family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER}).chat_model()


@pytest.fixture(scope="module")
def images():
    return [render(s, 64) for s in sample_scenes(12, "chat-vision-thread-test", "heldout")]


def ask(question, *images, **kw) -> ChatParams:
    return ChatParams((ChatTurn("user", (*range(len(images)), question)),), tuple(images), **kw)


def stream_until_running(engine, params):
    stream = engine.submit("stream", params, stream=True)
    while not engine.running:
        engine.step()
    return stream


def submit_built(engine, chat_id, params):
    chat = engine.submit(chat_id, params)
    if chat.pending is not None:
        chat.pending.result()
    return chat


@pytest.fixture
def held(monkeypatch):
    """Tower calls on the vision thread wait for ``release`` (each call sets ``started`` first)."""
    real = tower_module.image_features
    gate = type("Gate", (), {})()
    gate.started, gate.release, gate.calls = threading.Event(), threading.Event(), []

    def waiting(*args, **kwargs):
        gate.calls.append(args[2])
        gate.started.set()
        assert gate.release.wait(120), "the test never released the tower call"
        return real(*args, **kwargs)

    monkeypatch.setattr(tower_module, "image_features", waiting)
    return gate


def test_the_threads_embeddings_equal_the_inline_ones(chat, images):
    prompt = build_prompt(chat.model, chat.inputs(ask("Compare them", *images[:4])), "")
    with torch.no_grad():
        inline = {}
        for j, (t0, t1, _, _) in enumerate(prompt.images):  # each image alone, as the chunks run them
            features = {}
            inline[j] = chunk_embeddings(chat.model, prompt, t0, t1, features)
    got, seconds, tokens = tower_module.image_features(chat.model, prompt, [0, 1, 2, 3], "")
    assert sorted(got) == [0, 1, 2, 3] and seconds > 0
    assert tokens == sum(t1 - t0 for t0, t1, _, _ in prompt.images)
    for j in range(4):
        # one call over four images against four calls (the mm-hash cache splits it per image)
        assert torch.equal(got[j], inline[j]), (j, (got[j] - inline[j]).abs().max())


@pytest.mark.parametrize("costs", [None, Fixed(**SPLIT)], ids=["measured", "fixed"])
def test_greedy_answers_with_the_vision_thread_are_each_chats_alone(chat, images, costs):
    prompts = {
        "s0": ask("Describe it", images[0], max_tokens=30, ignore_eos=True),
        "big": ask("Compare them all", *images[1:9], max_tokens=8, ignore_eos=True),
        "two": ask("Which is larger?", images[9], images[10], max_tokens=10),
        "text": ask("hello there", max_tokens=12, ignore_eos=True),
    }
    arrivals = {0: ("s0",), 2: ("big",), 3: ("two", "text")}
    engine = ChatEngine(chat, THREAD, costs)
    chats = {}
    for step in range(800):
        for chat_id in arrivals.get(step, ()):
            chats[chat_id] = engine.submit(chat_id, prompts[chat_id])
        if step > max(arrivals) and not engine.has_work():
            break
        engine.step()
    for chat_id, params in prompts.items():
        assert chats[chat_id].result == chat.run(params), chat_id


def test_the_stream_decodes_while_a_tower_call_is_in_flight(chat, images, held):
    engine = ChatEngine(chat, THREAD, Fixed(**SPLIT))
    held.release.set()  # the stream's own image passes
    stream = stream_until_running(engine, ask("Describe it", images[0], max_tokens=30, ignore_eos=True))
    held.release.clear()
    held.started.clear()
    big = submit_built(engine, "big", ask("Compare them all", *images[1:9], max_tokens=2, ignore_eos=True))
    engine.step()  # admits it: its 8 images go to the vision thread as one call
    assert held.started.wait(60) and held.calls[-1] == list(range(8))
    first_image = big.prompt.images[0][0]
    for _ in range(4):  # the call is held: every step still decodes the stream, the joiner waits
        before = len(stream.tokens)
        engine.step()
        assert len(stream.tokens) == before + 1
        assert big.prefilled <= first_image and big.towers is not None and not big.features
    held.release.set()
    big.towers.future.result(60)
    engine.step()  # the embeddings are collected; the prompt's chunks go on from here
    assert big.towers is None
    while engine.has_work():
        engine.step()
    assert big.result == chat.run(big.params) and stream.result == chat.run(stream.params)
    assert big.result.timing.vision_s > 0


def test_with_no_chat_decoding_a_step_waits_for_the_tower(chat, images):
    engine = ChatEngine(chat, THREAD)
    one = engine.submit("one", ask("Compare them", *images[1:4], max_tokens=3, ignore_eos=True))
    engine.step()  # nobody decodes: it waits for its embeddings and prefills whole
    assert one.towers is None and engine.running == [one] and len(one.tokens) == 1
    while engine.has_work():
        engine.step()
    assert one.result == chat.run(one.params)


def test_a_failed_tower_call_fails_its_chat_alone(chat, images, monkeypatch):
    engine = ChatEngine(chat, THREAD, Fixed(**SPLIT))
    stream = stream_until_running(engine, ask("Describe it", images[0], max_tokens=12, ignore_eos=True))

    def broken(*args, **kwargs):
        raise ValueError("the tower broke")

    monkeypatch.setattr(tower_module, "image_features", broken)
    bad = submit_built(engine, "bad", ask("Compare them", *images[1:3], max_tokens=2))
    while engine.has_work():
        engine.step()
    assert isinstance(bad.error, ValueError) and "the tower broke" in str(bad.error)
    assert bad.features == {} and bad.kv is None and bad not in engine.prefilling
    assert stream.result == chat.run(stream.params)


def test_the_vision_thread_setting_is_a_bool():
    with pytest.raises(ValueError, match=r"vision_thread"):
        ChatEngineConfig(vision_thread=1)


def test_a_chat_cancelled_while_its_tower_call_runs_leaves_nothing_behind(chat, images, held):
    engine = ChatEngine(chat, THREAD, Fixed(**SPLIT))
    held.release.set()
    stream = stream_until_running(engine, ask("Describe it", images[0], max_tokens=20, ignore_eos=True))
    held.release.clear()
    gone = submit_built(engine, "gone", ask("Compare them", *images[1:5], max_tokens=2))
    engine.step()
    assert held.started.wait(60) and gone.towers is not None
    engine.cancel("gone")
    engine.step()
    assert gone.result.finish_reason == "cancelled" and gone not in engine.prefilling
    held.release.set()
    while engine.has_work():
        engine.step()
    assert gone.kv is None and gone.features == {} and stream.result == chat.run(stream.params)
