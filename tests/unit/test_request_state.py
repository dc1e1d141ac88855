"""The request state machine: every allowed move works, every other move raises."""

from __future__ import annotations

import itertools

import pytest

from triptych.control.request_state import (
    ACTIVE,
    CHAT_TRANSITIONS,
    TERMINAL,
    TRANSITIONS,
    InvalidTransition,
    RequestMachine,
    RequestState,
    StateTimeouts,
)

S = RequestState
GENERATION_STATES = [s for s in S if s is not S.CHATTING]
PATHS_TO = {
    S.QUEUED: [],
    S.ENCODING: [S.ENCODING],
    S.DENOISING: [S.ENCODING, S.DENOISING],
    S.DECODING: [S.ENCODING, S.DENOISING, S.DECODING],
    S.DONE: [S.ENCODING, S.DENOISING, S.DECODING, S.DONE],
    S.FAILED: [S.FAILED],
    S.CANCELLED: [S.CANCELLED],
    S.TIMED_OUT: [S.TIMED_OUT],
}


def machine_in(state: RequestState) -> RequestMachine:
    m = RequestMachine("r1")
    for step in PATHS_TO[state]:
        m.to(step)
    assert m.state is state
    return m


def test_happy_path_reaches_done():
    m = machine_in(S.DONE)
    assert m.history == [S.QUEUED, S.ENCODING, S.DENOISING, S.DECODING, S.DONE]
    assert m.generation == 1


@pytest.mark.parametrize(
    "src,dst", [(a, b) for a, b in itertools.product(GENERATION_STATES, S) if b not in TRANSITIONS[a]]
)
def test_every_invalid_transition_raises(src, dst):
    m = machine_in(src)
    with pytest.raises(InvalidTransition):
        m.to(dst)
    assert m.state is src


@pytest.mark.parametrize("src", sorted(ACTIVE - {S.CHATTING}))
@pytest.mark.parametrize("end", [S.FAILED, S.CANCELLED, S.TIMED_OUT])
def test_any_active_state_can_end(src, end):
    m = machine_in(src)
    m.to(end)
    assert m.state.terminal


@pytest.mark.parametrize("src", [S.ENCODING, S.DENOISING, S.DECODING])
def test_retry_goes_back_to_queued_with_a_new_generation(src):
    m = machine_in(src)
    m.to(S.QUEUED)
    assert m.generation == 2


def test_terminal_states_have_no_exit():
    assert all(not TRANSITIONS[t] for t in TERMINAL)


def test_per_state_timeouts():
    m = RequestMachine("r1", timeouts=StateTimeouts(queued_s=5, encoding_s=7), entered_at=100.0)
    assert not m.expired(104.9)
    assert m.expired(105.0)
    m.to(S.ENCODING, now=200.0)
    assert m.deadline() == 207.0
    m.to(S.CANCELLED, now=201.0)
    assert m.deadline() is None and not m.expired(10**9)


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="encoding_s"):
        StateTimeouts(encoding_s=0)


def test_a_chat_runs_queued_chatting_done_and_nothing_of_a_generation():
    m = RequestMachine("c1", table=CHAT_TRANSITIONS)
    for bad in (S.ENCODING, S.DENOISING, S.DECODING, S.DONE):
        with pytest.raises(InvalidTransition):
            m.to(bad)
    m.to(S.CHATTING)
    m.to(S.QUEUED)  # a retry on another encoder
    m.to(S.CHATTING)
    m.to(S.DONE)
    assert m.history == [S.QUEUED, S.CHATTING, S.QUEUED, S.CHATTING, S.DONE] and m.generation == 2


def test_a_generation_never_chats():
    m = RequestMachine("r1")
    with pytest.raises(InvalidTransition):
        m.to(S.CHATTING)
