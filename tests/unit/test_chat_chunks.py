"""Admission of prompt chunks by estimated time (``chat.chunks``) and the online cost model
(``chat.budget``), on fake prompts and fixed costs: no model, no clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from tests.helpers import FixedCosts as Fixed
from triptych.chat.budget import StepCosts
from triptych.chat.chunks import item_chunks, timed_chunks, tower_batch
from triptych.chat.config import ChatEngineConfig


@dataclass
class Prompt:
    length: int
    images: tuple = ()  # (first token, end token, first patch, end patch) per image

    def __len__(self) -> int:
        return self.length


@dataclass(eq=False)
class Chat:
    prompt: Prompt
    prefilled: int = 0
    features: dict = field(default_factory=dict)
    towers: object = None  # a tower call in flight (its ``images``), as the engine's vision thread has


def prompt_with(images: int, text: int = 4, tokens: int = 16) -> Prompt:
    """``text`` text tokens, then ``images`` images of ``tokens`` tokens each with ``text`` between, then
    ``text`` more."""
    spans, at = [], text
    for _ in range(images):
        spans.append((at, at + tokens, 0, 0))
        at += tokens + text
    return Prompt(at, tuple(spans))


def run(chats, budget, costs, least=64):
    """Advance the chats through ``timed_chunks`` as the engine does; each step's chunks."""
    steps = []
    while any(c.prefilled < len(c.prompt) for c in chats):
        live = [c for c in chats if c.prefilled < len(c.prompt)]
        chunks = timed_chunks(live, budget, costs, least)
        assert chunks and chunks[0][0] is live[0]  # the first chat always progresses
        for chat, end in chunks:
            assert end > chat.prefilled
            chat.prefilled = end
        steps.append(chunks)
        assert len(steps) < 1000
    return steps


def images_in(chat, start, end) -> int:
    return sum(1 for t0, t1, _, _ in chat.prompt.images if t0 >= start and t0 < end)


def test_a_budget_admits_whole_images_while_their_estimate_fits():
    # an image: 16 tokens x (0.02 vision + 0.005 prefill) = 0.4 s; text: 4 x 0.005 = 0.02 s
    costs = Fixed(vision=0.02, prefill=0.005, decode=1.0)
    chat = Chat(prompt_with(8))
    chunks = timed_chunks([chat], 1.0, costs, 64)
    ((got, end),) = chunks
    assert got is chat and images_in(chat, 0, end) == 2  # text, image, text, image, text: 0.86; a third: 1.26
    starts = {t0 for t0, _, _, _ in chat.prompt.images}
    assert end in starts  # it stops before the image that does not fit, not inside it
    assert timed_chunks([chat], 10.0, costs, 64) == [(chat, len(chat.prompt))]  # all of it fits


def test_an_image_over_the_budget_runs_alone():
    costs = Fixed(vision=100.0, prefill=0.005, decode=1.0)
    first, second = Chat(prompt_with(3, text=0)), Chat(prompt_with(1))
    assert timed_chunks([first, second], 1.0, costs, 64) == [(first, 16)]  # one image, nobody else
    first.prefilled = 16
    assert timed_chunks([first, second], 1.0, costs, 64) == [(first, 32)]


def test_unmeasured_costs_admit_only_the_first_chats_first_unit():
    costs = StepCosts()  # nothing measured: every estimate is infinite
    chats = [Chat(prompt_with(2)), Chat(prompt_with(0, text=10))]
    assert timed_chunks(chats, 1.0, costs, 64) == [(chats[0], 4)]  # its leading text run
    chats[0].prefilled = 4
    assert timed_chunks(chats, 1.0, costs, 64) == [(chats[0], 20)]  # then its first image


def test_text_is_split_by_the_budget_and_the_first_chat_gets_at_least_its_least():
    costs = Fixed(vision=0.0, prefill=1 / 128, decode=1.0)  # binary fractions: exact sums
    long_text = Chat(Prompt(500))
    assert timed_chunks([long_text], 1.0, costs, 64) == [(long_text, 128)]
    assert timed_chunks([long_text], 0.25, costs, 64) == [(long_text, 64)]  # 32 fit; at least its least
    behind = Chat(Prompt(500))
    assert timed_chunks([long_text, behind], 1.5, costs, 64) == [(long_text, 192)]  # nothing left behind
    short = Chat(Prompt(30))
    assert timed_chunks([short, behind], 1.0, costs, 64) == [(short, 30), (behind, 98)]


def test_a_feature_already_computed_costs_no_vision():
    costs = Fixed(vision=1.0, prefill=0.001, decode=1.0)
    chat = Chat(prompt_with(1, text=0), prefilled=4, features={0: object()})  # inside image 0, tower ran
    other = Chat(Prompt(10))
    assert timed_chunks([chat, other], 1.0, costs, 64) == [(chat, 16), (other, 10)]  # 16 s of tower: no room
    chat.features.clear()
    assert timed_chunks([chat, other], 1.0, costs, 64) == [(chat, 16)]


@pytest.mark.parametrize("seed", range(6))
def test_the_first_chat_finishes_within_the_stated_bound(seed):
    """Whatever the budget and costs, a prompt with n images and t text tokens finishes its prefill
    within 2n + 1 + ceil(t / least) steps of becoming the first prefilling chat."""
    rng = random.Random(seed)
    least = rng.choice([4, 16, 64])
    costs = Fixed(vision=rng.choice([0.001, 1.0, 100.0]), prefill=rng.choice([0.0, 0.01, 10.0]), decode=1.0)
    chats = [Chat(prompt_with(rng.randint(0, 9), text=rng.randint(0, 90), tokens=rng.randint(1, 40))) for _ in range(4)]
    bounds = []
    for c in chats:
        n = len(c.prompt.images)
        t = len(c.prompt) - sum(t1 - t0 for t0, t1, _, _ in c.prompt.images)
        bounds.append(2 * n + 1 + math.ceil(t / least))
    steps = run(chats, rng.choice([0.0, 0.5, 1.0, 5.0]), costs, least)
    finished = {}
    for i, chunks in enumerate(steps):
        for chat, end in chunks:
            if end == len(chat.prompt):
                finished[id(chat)] = i
    became_first = 0
    for chat, bound in zip(chats, bounds):
        assert finished[id(chat)] - became_first + 1 <= bound
        became_first = finished[id(chat)] + 1


def test_item_chunks_count_tokens_and_images():
    chat = Chat(prompt_with(4))
    ((got, end),) = item_chunks([chat], 1000, 2)
    assert images_in(chat, 0, end) == 2 and end == chat.prompt.images[2][0]
    assert item_chunks([chat], 10, 2) == [(chat, 10)]


def test_costs_seed_from_the_first_measurement_then_move_by_their_ema():
    costs = StepCosts(alpha=0.5)
    assert not costs.known("vision") and costs.estimate("vision", 3) == math.inf
    assert costs.estimate("vision", 0) == 0.0
    costs.observe("vision", 10, 1.0)  # 0.1 s per token
    assert costs.estimate("vision", 3) == pytest.approx(0.3)
    costs.observe("vision", 10, 3.0)  # 0.3 s per token: halfway there
    assert costs.estimate("vision", 1) == pytest.approx(0.2)
    costs.observe("prefill", 4, -1.0)  # a mixed forward faster than the decode estimate: 0, not negative
    assert costs.estimate("prefill", 4) == 0.0
    costs.observe("decode", 0, 5.0)  # no units: nothing learnt
    assert not costs.known("decode")
    with pytest.raises(ValueError, match="alpha"):
        StepCosts(alpha=0)


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan, 101, "1", True])
def test_the_step_time_budget_is_refused_outside_its_bounds_naming_it(value):
    with pytest.raises(ValueError, match=r"step_time_budget"):
        ChatEngineConfig(step_time_budget=value)
    assert ChatEngineConfig(step_time_budget=0).step_time_budget == 0  # 0: by item counts


def test_the_per_call_fit_recovers_a_known_overhead_and_per_token_cost():
    """Tower calls of 1 to 8 images (16 tokens each) costing 4 ms a call plus 0.03 ms a token: the
    fit finds both, and prices an 8-image call as one overhead, not eight."""
    costs = StepCosts()
    for n in [1, 8, 3, 2, 5, 8, 1, 4]:
        costs.observe("vision", 16 * n, 0.004 + 0.00003 * 16 * n)
    assert costs.per_call["vision"] == pytest.approx(0.004, rel=1e-9)
    assert costs.per_unit["vision"] == pytest.approx(0.00003, rel=1e-9)
    assert costs.estimate("vision", 128) == pytest.approx(0.004 + 0.00003 * 128)
    assert costs.estimate("vision", 128, calls=8) == pytest.approx(8 * 0.004 + 0.00003 * 128)


def test_the_fit_follows_a_change_in_cost_and_stays_non_negative():
    costs = StepCosts(fit_decay=0.5)
    rng = random.Random(3)
    for _ in range(60):  # the overhead halves: the recent calls weigh most
        n = rng.randint(1, 8)
        costs.observe("vision", 16 * n, 0.002 + 0.00005 * 16 * n)
    assert costs.per_call["vision"] == pytest.approx(0.002, rel=1e-6)
    for n in [1, 2, 4, 8]:  # cost falls with size (noise): no negative per-token price
        costs.observe("vision", 16 * n, 0.01 / n)
    assert costs.per_unit["vision"] >= 0 and costs.per_call["vision"] >= 0


def test_calls_all_of_one_size_leave_the_per_unit_average_alone():
    costs = StepCosts(alpha=0.5)
    costs.observe("vision", 16, 0.016)
    costs.observe("vision", 16, 0.032)
    assert "vision" not in costs.per_call
    assert costs.per_unit["vision"] == pytest.approx((0.001 + 0.002) / 2)
    assert costs.estimate("vision", 16) == pytest.approx(0.024)


def test_a_fitted_overhead_stays_when_the_calls_become_all_one_size():
    """Calls of 1 to 8 images fit 4 ms + 0.03 ms a token; then 200 one-image calls at 6 ms (the
    sizes no longer tell the terms apart): a per-call term stays (an 8-image call is still priced
    below eight one-image calls) and the one-image estimate follows the new cost."""
    costs = StepCosts(fit_decay=0.9)
    for n in [1, 8, 3, 2, 5, 8, 1, 4]:
        costs.observe("vision", 16 * n, 0.004 + 0.00003 * 16 * n)
    for _ in range(200):
        costs.observe("vision", 16, 0.006)
    assert costs.fitted("vision") and costs.per_call["vision"] > 0.004
    assert costs.estimate("vision", 16) == pytest.approx(0.006, rel=1e-6)
    assert costs.estimate("vision", 128) < 8 * costs.estimate("vision", 16) / 2


@dataclass
class Towers:
    images: tuple


def test_a_chunk_stops_before_an_image_still_on_the_vision_thread():
    """By time and by items: the chat whose embeddings are in flight prefills only the text before
    them; the next chat, ready, is the one that progresses past the budget."""
    for admit in (
        lambda live: timed_chunks(live, 1.0, Fixed(vision=1.0, prefill=0.001), 64),
        lambda live: item_chunks(live, 64, 2),
    ):
        waiting = Chat(prompt_with(2), towers=Towers((0, 1)))
        ready = Chat(prompt_with(1))
        assert admit([waiting, ready])[0] == (waiting, 4)  # its first text run, up to the first image
        waiting.prefilled = 4
        ((chat, end),) = admit([waiting, ready])
        assert chat is ready and end > 0  # the ready one is the first to progress
        waiting.features.update({0: None, 1: None})  # the call is in: it goes on
        waiting.towers = None
        assert admit([waiting])[0][1] > 4


def fitted(per_call: float, **per_unit: float) -> Fixed:
    costs = Fixed(**per_unit)
    costs.per_call = {"vision": per_call}
    return costs


def test_a_step_that_runs_the_tower_fills_the_call_within_the_allowance():
    """Overhead 4 ms and 1 ms an image against a 1 ms budget: the image the chunk reaches is 5 ms,
    so with stretch 1 the call may cost 10 ms: it holds that image and the next five waiting,
    across chats in admission order."""
    costs = fitted(0.004, vision=0.001 / 16, prefill=0.00001)
    a, b = Chat(prompt_with(2), prefilled=4), Chat(prompt_with(8))
    chunks = timed_chunks([a, b], 0.001, costs, 4)
    assert chunks == [(a, 20)]  # its first image: over the budget already
    batch = tower_batch([a, b], chunks, costs, 0.001, 1.0)
    assert [(chat is a, j) for chat, j in batch] == [
        (True, 0),
        (True, 1),
        (False, 0),
        (False, 1),
        (False, 2),
        (False, 3),
    ]
    assert len(tower_batch([a, b], chunks, costs, 0.001, 3.0)) == 10  # 20 ms: all ten
    assert tower_batch([a, b], chunks, costs, 0.001, 0.0) == [(a, 0)]  # stretch 0: what the chunks reach


def test_without_a_per_call_term_the_call_grows_by_the_stretch_and_within_budget_not_at_all():
    a, b = Chat(prompt_with(2)), Chat(prompt_with(8))
    linear = Fixed(vision=0.001 / 16, prefill=0.00001)  # 1 ms an image, nothing per call
    assert len(tower_batch([a, b], [(a, 20)], linear, 0.0005, 1.0)) == 2  # twice the forced image's 1 ms
    assert len(tower_batch([a, b], [(a, 20)], linear, 0.0005, 2.0)) == 3
    costs = fitted(0.004, vision=0.001 / 16, prefill=0.00001)
    assert tower_batch([a, b], [(a, 20)], costs, 0.01, 1.0) == [(a, 0)]  # 5 ms fit a 10 ms budget
    assert tower_batch([a, b], [(a, 3)], costs, 0.001, 1.0) == []  # no call for waiting images alone


def test_the_call_holds_one_tenants_images():
    costs = fitted(0.004, vision=0.001 / 16, prefill=0.00001)  # a 10 ms call: six images
    a, other, b = Chat(prompt_with(1)), Chat(prompt_with(2)), Chat(prompt_with(2))
    a.params, other.params, b.params = Params("t1"), Params("t2"), Params("t1")
    batch = tower_batch([a, other, b], [(a, 20)], costs, 0.001, 1.0)
    assert [(chat, j) for chat, j in batch] == [(a, 0), (b, 0), (b, 1)]


@dataclass
class Params:
    tenant: str
