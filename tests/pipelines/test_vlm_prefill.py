"""Batched and chunked prefill in the chat engine (``vlm.prefill``) on the packaged default model.

Chats admitted in one step prefill in one forward (rows of different lengths, with images, with
prefix-cache hits of different lengths) and answer token-identically to each alone
(``ChatModel.run``); a long prompt is prefilled in chunks of ``prefill_tokens_per_step`` while the
running chats get a token every step."""

from __future__ import annotations

import math

import pytest

from shapeworld import render, sample_scenes
from triptych.chat import ChatParams, ChatTurn
from triptych.chat.config import ChatEngineConfig
from triptych.chat.engine import ChatEngine
from triptych.families.base import Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class


@pytest.fixture(scope="module")
def chat():
    return family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER}).chat_model()


@pytest.fixture(scope="module")
def images():
    return [render(s, 64) for s in sample_scenes(8, "chat-prefill-test", "heldout")]


def ask(question, *images, system=None, **kw) -> ChatParams:
    turns = (ChatTurn("system", (system,)),) if system else ()
    return ChatParams((*turns, ChatTurn("user", (*range(len(images)), question))), tuple(images), **kw)


def drain(engine: ChatEngine) -> None:
    for _ in range(500):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_chats_admitted_together_prefill_in_one_forward_and_answer_as_alone(chat, images):
    prompts = [
        ask("hello there", max_tokens=10, ignore_eos=True),
        ask("What is in this image?", images[0], max_tokens=16),
        ask("Compare these two", images[1], images[2], system="Be brief.", max_tokens=20, ignore_eos=True),
        ask("Which one is largest?", *images[3:6], max_tokens=12, ignore_eos=True),
    ]
    lengths = {len(chat.inputs(p)["input_ids"][0]) for p in prompts}
    assert len(lengths) == len(prompts)  # rows of different lengths: the padding is exercised
    engine = ChatEngine(
        chat, ChatEngineConfig(prefill_tokens_per_step=4096, prefill_images_per_step=16, prefix_cache_mb=0)
    )
    chats = [engine.submit(i, p) for i, p in enumerate(prompts)]
    engine.step()
    assert engine.stats.prefill_forwards == 1 and engine.stats.prefill_rows == len(prompts)
    assert len(engine.running) == len(prompts)
    drain(engine)
    assert engine.stats.prefill_forwards == 1
    for c, p in zip(chats, prompts):
        assert c.result == chat.run(p), c.id


def test_a_long_prompt_prefills_in_chunks_while_the_running_chats_decode(chat, images, monkeypatch):
    """By item counts (``step_time_budget`` 0), each step prefills at most
    ``prefill_tokens_per_step`` tokens and runs the vision tower for at most
    ``prefill_images_per_step`` images, and every running chat gets its next token."""
    budget, per_step = 32, 2
    tower = chat.model.model.get_image_features
    calls = []
    monkeypatch.setattr(chat.model.model, "get_image_features", lambda *a, **k: calls.append(1) or tower(*a, **k))
    config = ChatEngineConfig(
        step_time_budget=0, prefill_tokens_per_step=budget, prefill_images_per_step=per_step, prefix_cache_mb=0
    )
    engine = ChatEngine(chat, config)
    streams = [engine.submit(i, ask("Describe it", images[i], max_tokens=40, ignore_eos=True)) for i in range(2)]
    while len(engine.running) < 2:
        engine.step()
    long_prompt = ask("Compare them all", *images, max_tokens=8, ignore_eos=True)
    length = len(chat.inputs(long_prompt)["input_ids"][0])
    big = engine.submit("big", long_prompt)
    forwards = engine.stats.prefill_forwards
    calls.clear()
    while not big.tokens:
        before, runs = [len(s.tokens) for s in streams], len(calls)
        computed = engine.stats.prefill_computed
        engine.step()
        assert engine.stats.prefill_computed - computed <= budget
        assert len(calls) - runs <= per_step
        assert [len(s.tokens) for s in streams] == [n + 1 for n in before]  # nobody waited a step
    assert len(calls) == len(images)  # each image's tower ran once, across the chunks
    assert engine.stats.prefill_forwards - forwards >= max(math.ceil(length / budget), len(images) / per_step)
    drain(engine)
    monkeypatch.undo()  # generate below runs the tower its own way
    assert big.result == chat.run(long_prompt)
    for i, s in enumerate(streams):
        assert s.result == chat.run(ask("Describe it", images[i], max_tokens=40, ignore_eos=True))


def test_prefix_hits_of_different_lengths_prefill_together_computing_only_new_tokens(chat, images):
    system = "You describe images."
    engine = ChatEngine(
        chat, ChatEngineConfig(prefill_tokens_per_step=4096, prefill_images_per_step=16, prefix_cache_mb=8)
    )
    first = engine.submit(0, ask("What is in this image?", images[0], system=system, max_tokens=4))
    drain(engine)
    assert first.result is not None
    prompts = [
        ask("What colour is it?", images[0], system=system, max_tokens=12),  # reuses past the image
        ask("What is in this image?", images[1], system=system, max_tokens=12),  # reuses up to the image
        ask("Say something", system="Another system prompt.", max_tokens=6, ignore_eos=True),
    ]
    computed, reused, forwards = (
        engine.stats.prefill_computed,
        engine.stats.prefill_reused,
        engine.stats.prefill_forwards,
    )
    chats = [engine.submit(i + 1, p) for i, p in enumerate(prompts)]
    engine.step()
    assert engine.stats.prefill_forwards == forwards + 1
    new_reused = engine.stats.prefill_reused - reused
    total = sum(len(chat.inputs(p)["input_ids"][0]) for p in prompts)
    assert engine.stats.prefill_computed - computed == total - new_reused
    hits = [c.prefix is not None for c in chats]
    assert hits[:2] == [True, True]
    drain(engine)
    for c, p in zip(chats, prompts):
        assert c.result == chat.run(p), c.id


def test_one_forward_per_step_when_chats_join_while_others_decode(chat, images, monkeypatch):
    """A joiner's prefill chunk runs in the running chats' decode forward (mixed prefill and
    decode): every step is one model forward, with images, chunks over several steps and a
    prefix hit, and every answer is the one it gets alone."""
    system = "You describe images."
    config = ChatEngineConfig(
        step_time_budget=0, prefill_tokens_per_step=48, prefill_images_per_step=1, prefix_cache_mb=8
    )
    engine = ChatEngine(chat, config)
    forward = chat.model.model.forward
    calls = []
    monkeypatch.setattr(chat.model.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    prompts = {
        "a": ask("Describe it", images[0], system=system, max_tokens=40, ignore_eos=True),
        "b": ask("hello there", max_tokens=30, ignore_eos=True),
        "c": ask("What colour is it?", images[0], system=system, max_tokens=12, ignore_eos=True),  # prefix hit
        "d": ask("Compare these two", images[1], images[2], max_tokens=10, ignore_eos=True),  # several chunks
        "e": ask("Where is it?", images[3], max_tokens=8),
    }
    arrivals = {0: "ab", 3: "c", 5: "de", 9: "e"}
    chats, mixed = {}, 0
    for step in range(500):
        for chat_id in arrivals.get(step, ""):
            chats[chat_id] = engine.submit(chat_id, prompts[chat_id])
        if not engine.has_work():
            break
        before = (len(calls), engine.stats.prefill_forwards, engine.stats.decode_forwards)
        engine.step()
        assert len(calls) - before[0] == 1, step
        mixed += engine.stats.prefill_forwards > before[1] and engine.stats.decode_forwards > before[2]
    assert engine.forwards == len(calls)
    assert chats["c"].prefix is None and engine.stats.prefill_reused > 0
    assert mixed >= 4, mixed  # c, d (at least twice: 48-token chunks) and e joined while others decoded
    monkeypatch.undo()
    for chat_id, params in prompts.items():
        assert chats[chat_id].result == chat.run(params), chat_id


def test_a_failed_mixed_forward_runs_its_prefill_and_decode_apart(chat, monkeypatch):
    import triptych.chat.engine as engine_module

    real = engine_module.prefill
    failed = []

    def mixed_fails(model, rows, decode=None):
        if decode is not None:
            failed.append(len(decode))
            raise RuntimeError("mixed forward failed")
        return real(model, rows)

    monkeypatch.setattr(engine_module, "prefill", mixed_fails)
    engine = ChatEngine(chat, ChatEngineConfig(prefix_cache_mb=0))
    first = engine.submit("first", ask("hello there", max_tokens=12, ignore_eos=True))
    engine.step()
    joiner = engine.submit("joiner", ask("how are you", max_tokens=6, ignore_eos=True))
    drain(engine)
    assert failed == [1]  # the joiner's step tried one mixed forward, then ran its parts apart
    assert first.result == chat.run(first.params) and joiner.result == chat.run(joiner.params)
