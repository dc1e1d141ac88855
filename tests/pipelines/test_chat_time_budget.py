"""The chat engine's step time budget (``ChatEngineConfig.step_time_budget``) on the packaged
default model: vision encode and prefill admitted beside decoding chats by estimated seconds.

Steps and tower runs are counted against fixed costs (``Fixed``: seconds per unit set by the test,
never learnt), so nothing here reads a clock: greedy answers are those of each chat alone (as by
item counts and with measured costs), a many-image chat spreads over steps, a decoding stream gets
a token every step while a flood of 8-image chats is admitted, an image over the budget runs
alone, and the first prefilling chat progresses every step; through the encoder runner the encoder
layer's batched tower takes its images by the same budget."""

from __future__ import annotations

import math

import pytest

from shapeworld import render, sample_scenes
from tests.helpers import EncoderPort as Port
from tests.helpers import FixedCosts as Fixed
from triptych.chat import ChatParams, ChatTurn
from triptych.chat.config import ChatEngineConfig
from triptych.chat.engine import ChatEngine
from triptych.control import wire
from triptych.families.base import Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class
from triptych.worker.runners.encoder import EncoderRunner

# an image of the packaged processor is 16 tokens: 16 x (0.02 + 0.005) = 0.4 s by these costs, so a
# budget of one decode step (1 s) holds two images and the text around them, never three
SPLIT = {"decode": 1.0, "vision": 0.02, "prefill": 0.005}


@pytest.fixture(scope="module")
def family():
    return family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER})


@pytest.fixture(scope="module")
def chat(family):
    return family.chat_model()


@pytest.fixture(scope="module")
def images():
    return [render(s, 64) for s in sample_scenes(17, "chat-time-budget-test", "heldout")]


def ask(question, *images, **kw) -> ChatParams:
    return ChatParams((ChatTurn("user", (*range(len(images)), question)),), tuple(images), **kw)


@pytest.fixture
def towers(chat, monkeypatch):
    """Images the engine ran through the vision tower (one entry each; a call may hold several)."""
    tower = chat.model.model.get_image_features
    calls = []
    monkeypatch.setattr(
        chat.model.model, "get_image_features", lambda *a, **k: calls.extend([1] * len(a[1])) or tower(*a, **k)
    )
    return calls


def submit_built(engine, chat_id, params):
    """Submit and wait for its prompt (built on the engine's prompt thread while chats decode), so
    the next step admits it whatever the thread's pace."""
    chat = engine.submit(chat_id, params)
    if chat.pending is not None:
        chat.pending.result()
    return chat


def stream_until_running(engine, params) -> object:
    stream = engine.submit("stream", params, stream=True)
    while not engine.running:
        engine.step()
    return stream


def test_greedy_answers_are_the_same_by_time_by_items_and_alone(chat, images):
    prompts = {
        "s0": ask("Describe it", images[0], max_tokens=30, ignore_eos=True),
        "s1": ask("hello there", max_tokens=24, ignore_eos=True),
        "big": ask("Compare them all", *images[1:9], max_tokens=8, ignore_eos=True),
        "two": ask("Which is larger?", images[9], images[10], max_tokens=10),
    }
    arrivals = {0: ("s0", "s1"), 2: ("big",), 3: ("two",)}
    configs = {
        "items": (ChatEngineConfig(step_time_budget=0, prefix_cache_mb=0), None),
        "time, measured": (ChatEngineConfig(prefix_cache_mb=0), None),
        "time, fixed": (ChatEngineConfig(prefix_cache_mb=0), Fixed(**SPLIT)),
        "time, tight": (ChatEngineConfig(step_time_budget=0.1, prefix_cache_mb=0), Fixed(**SPLIT)),
    }
    answers = {}
    for name, (config, costs) in configs.items():
        engine = ChatEngine(chat, config, costs)
        chats = {}
        for step in range(500):
            for chat_id in arrivals.get(step, ()):
                chats[chat_id] = engine.submit(chat_id, prompts[chat_id])
            if step > max(arrivals) and not engine.has_work():
                break
            engine.step()
        answers[name] = {k: c.result for k, c in chats.items()}
    for chat_id, params in prompts.items():
        alone = chat.run(params)
        assert {name: got[chat_id] for name, got in answers.items()} == dict.fromkeys(configs, alone), chat_id


def test_a_many_image_chat_spreads_over_steps_and_the_stream_gets_a_token_every_step(chat, images, towers):
    engine = ChatEngine(chat, ChatEngineConfig(prefix_cache_mb=0), Fixed(**SPLIT))
    stream = stream_until_running(engine, ask("Describe it", images[0], max_tokens=40, ignore_eos=True))
    big = submit_built(engine, "big", ask("Compare them all", *images[1:9], max_tokens=4, ignore_eos=True))
    towers.clear()
    per_step = []
    while not big.tokens:
        before, runs = len(stream.tokens), len(towers)
        engine.step()
        per_step.append(len(towers) - runs)
        assert len(stream.tokens) == before + 1  # the stream never waits a step
    assert per_step == [2, 2, 2, 2]  # 8 images, two a step: two fit the budget, a third does not


def test_a_stream_keeps_its_pace_under_a_flood_of_8_image_chats_and_every_one_is_answered(chat, images, towers):
    """A chat with 8 new images arrives every 2 steps (more vision than the budget admits): the
    stream gets a token every step, no step runs more than the budget's two images, and the flood's
    chats get their first tokens in arrival order."""
    engine = ChatEngine(chat, ChatEngineConfig(prefix_cache_mb=0), Fixed(**SPLIT))
    stream = stream_until_running(engine, ask("Describe it", images[0], max_tokens=48, ignore_eos=True))
    towers.clear()
    flood, first_token_step = [], {}
    for step in range(200):
        if step % 2 == 0 and step < 16:
            pics = images[1 + (step % 3) : 9 + (step % 3)]
            flood.append(
                submit_built(engine, f"f{step}", ask(f"Compare them {step}", *pics, max_tokens=2, ignore_eos=True))
            )
        if step >= 16 and not engine.has_work():
            break
        decoding, before, runs = not stream.done, len(stream.tokens), len(towers)
        engine.step()
        if decoding:
            assert len(towers) - runs <= 2, step
            assert len(stream.tokens) == before + 1, step
        for c in flood:
            if c.tokens and c.id not in first_token_step:
                first_token_step[c.id] = step
    assert stream.result.completion_tokens == 48 and len(towers) == 8 * len(flood)
    assert all(c.result is not None and c.result.completion_tokens == 2 for c in flood)
    steps = [first_token_step.get(c.id, math.inf) for c in flood]
    assert steps == sorted(steps)


@pytest.mark.parametrize("stretch", [0.0, 1.0])
def test_an_image_over_the_budget_runs_alone_and_the_first_chat_progresses_every_step(chat, images, towers, stretch):
    """Vision estimated at 100 s an image against a 1 s budget. With no batching of the waiting
    images (``vision_call_stretch`` 0) a step that runs an image runs that image alone (the first
    prefilling chat's; no other chunk); batched (1: two images a call, by the per-image price),
    the step's call holds at most two. Either way that chat's prefill takes no more steps than the
    stated bound."""
    config = ChatEngineConfig(prefix_cache_mb=0, vision_call_stretch=stretch)
    engine = ChatEngine(chat, config, Fixed(decode=1.0, vision=100.0, prefill=0.005))
    stream = stream_until_running(engine, ask("Describe it", images[0], max_tokens=40, ignore_eos=True))
    first_params = ask("Compare them", *images[1:5], max_tokens=2, ignore_eos=True)
    first = submit_built(engine, "first", first_params)
    second = submit_built(engine, "second", ask("Compare these", *images[5:8], max_tokens=2, ignore_eos=True))
    towers.clear()
    steps = 0
    spans = {(t0, t1) for t0, t1, _, _ in first.prompt.images}
    while not first.tokens:
        before, runs, at, behind = len(stream.tokens), len(towers), first.prefilled, second.prefilled
        engine.step()
        steps += 1
        assert len(towers) - runs <= (1 if stretch == 0 else 2) and len(stream.tokens) == before + 1
        if len(towers) > runs and stretch == 0:  # the image, alone
            assert (at, first.prefilled) in spans and second.prefilled == behind
    assert len(towers) == 4
    n = len(first.prompt.images)
    text = len(first.prompt) - sum(t1 - t0 for t0, t1, _, _ in first.prompt.images)
    assert n == 4 and steps <= 2 * n + 1 + math.ceil(text / engine.config.prefill_tokens_per_step)
    while engine.has_work():
        engine.step()
    assert first.result.completion_tokens == 2
    assert second.result.completion_tokens == 2


def test_measured_costs_decode_alone_once_then_admit_by_time(chat, images):
    """With nothing measured, the first step beside a decoding chat decodes alone (its time seeds
    the decode estimate, the budget's unit); after it, chunks join the decode forward."""
    engine = ChatEngine(chat, ChatEngineConfig(prefix_cache_mb=0))
    stream = stream_until_running(engine, ask("hello there", max_tokens=20, ignore_eos=True))
    assert not engine.costs.known("decode") and engine.step_budget_s() == math.inf
    joiner = submit_built(engine, "joiner", ask("Compare them", *images[:3], max_tokens=4))
    prefills = engine.stats.prefill_forwards
    engine.step()
    assert engine.prefilling == [joiner] and engine.stats.prefill_forwards == prefills  # decoded alone
    assert engine.costs.known("decode")
    assert 0 < engine.step_budget_s() < math.inf
    engine.step()
    assert engine.stats.prefill_forwards == prefills + 1  # joined the decode forward
    assert joiner.prefilled == joiner.prompt.images[0][0] and not engine.costs.known("vision")  # one unit
    engine.step()
    assert joiner.prefilled == joiner.prompt.images[0][1] and engine.costs.known("vision")  # its first image
    while engine.has_work():
        engine.step()
    assert joiner.result == chat.run(joiner.params) and stream.result == chat.run(stream.params)


def test_the_encoder_layer_takes_a_floods_images_by_the_same_budget(family, images):
    """Through the encoder runner: while a streamed chat decodes, each ``execute()``'s batched
    tower takes only the images its estimate fits in the engine's step budget (one decode step here
    holds three: 16 tokens x 0.02 s), and the stream gets a token every ``execute()``."""
    port = Port()
    runner = EncoderRunner(family, port, ChatEngineConfig(prefix_cache_mb=0))
    runner.layer_costs = Fixed(vision=0.02)
    stream_params = ask("Describe it", images[0], max_tokens=40, ignore_eos=True)
    runner.accept(wire.chat_to_wire("stream", 0, stream_params, stream=True))
    runner.engine.costs = Fixed(**SPLIT)
    while not runner.engine.running:
        runner.execute()
    (stream,) = runner.engine.running
    for i in range(2):
        flood = ask("Compare them", *images[8 * i + 1 : 8 * i + 9], max_tokens=2)
        runner.accept(wire.chat_to_wire(f"f{i}", 0, flood, stream=False))
    taken = []
    pending = runner.layer.pending()
    while runner.layer.pending():
        before = len(stream.tokens)
        runner.execute()
        taken.append(pending - runner.layer.pending())
        pending = runner.layer.pending()
        assert len(stream.tokens) == before + 1
    assert max(taken) == 3 and sum(taken) == 16
    while runner.has_work():
        runner.execute()
    assert not port.failed


def test_a_tower_overhead_over_the_budget_batches_the_waiting_images_into_one_call(chat, images, monkeypatch):
    """A fitted per-call overhead of 2 s against a 1 s budget (0.32 s of work an image): a step
    that must run an image's tower (2.32 s) runs it over all eight (2 + 8 x 0.32 <= 2 x 2.32 s,
    stretch 1), their tokens prefill in the steps after at prefill's price: one stall for eight
    images, the stream a token every step, the answers as alone."""
    tower = chat.model.model.get_image_features
    calls = []
    monkeypatch.setattr(
        chat.model.model, "get_image_features", lambda *a, **k: calls.append(len(a[1])) or tower(*a, **k)
    )
    costs = Fixed(**SPLIT)
    costs.per_call = {"vision": 2.0}
    engine = ChatEngine(chat, ChatEngineConfig(prefix_cache_mb=0, vision_call_stretch=1.0), costs)
    stream = stream_until_running(engine, ask("Describe it", images[0], max_tokens=40, ignore_eos=True))
    big = submit_built(engine, "big", ask("Compare them all", *images[1:9], max_tokens=4, ignore_eos=True))
    calls.clear()
    while not big.tokens:
        before = len(stream.tokens)
        engine.step()
        assert len(stream.tokens) == before + 1
    assert calls == [8]
    while engine.has_work():
        engine.step()
    monkeypatch.undo()
    assert big.result == chat.run(big.params) and stream.result == chat.run(stream.params)
