"""The encoder runner's chats on the packaged default model: concurrent chats advance together (one
engine step, one forward for all of them, per ``execute()``), encodes take turns with them, the
answers are those of each chat alone, and an aborted chat sends nothing more."""

from __future__ import annotations

import pytest

from shapeworld import render, sample_scenes
from tests.helpers import EncoderPort as Port
from triptych.chat import ChatParams, ChatTurn
from triptych.chat.config import ChatEngineConfig
from triptych.control import protocol as P
from triptych.control import wire
from triptych.families.base import GenerationParams, Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class
from triptych.worker.runners.encoder import EncoderRunner


@pytest.fixture(scope="module")
def family():
    return family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER})


def chat_params(i: int) -> ChatParams:
    image = render(sample_scenes(4, "runner-chat-test", "heldout")[i], 64)
    return ChatParams((ChatTurn("user", (0, "What is in this image?")),), (image,), max_tokens=12 + i, ignore_eos=True)


def test_concurrent_chats_share_each_forward_and_encodes_take_turns(family):
    port = Port()
    runner = EncoderRunner(family, port, ChatEngineConfig(max_running_chats=8))
    params = [chat_params(i) for i in range(4)]
    for i, p in enumerate(params):
        runner.accept(wire.chat_to_wire(f"c{i}", 0, p, stream=True))
    encode = family.resolve(GenerationParams(prompt="a red square", seed=0))
    for i in range(2):
        runner.accept(
            P.EncodeTask(request_id=f"e{i}", generation=0, params=wire.params_to_wire(encode), denoiser="den-0")
        )
    order = []
    while runner.has_work():
        encodes, forwards = len(runner.ready), runner.engine.stats.decode_forwards
        runner.execute()
        order.append("encode" if len(runner.ready) < encodes else "chat")
        assert runner.engine.stats.decode_forwards - forwards <= 1  # one forward per step for all chats
    assert order[:4] == ["encode", "chat", "encode", "chat"]  # turns while both wait
    done = {m.request_id: m for m in port.sent if isinstance(m, P.ChatDone)}
    for i, p in enumerate(params):
        alone = family.chat_model().run(p)
        assert done[f"c{i}"].text == alone.text and done[f"c{i}"].completion_tokens == alone.completion_tokens
        pieces = "".join(m.text for m in port.sent if isinstance(m, P.ChatDelta) and m.request_id == f"c{i}")
        assert pieces == alone.text
    assert {m.request_id for m in port.sent if isinstance(m, P.EncodeDone)} == {"e0", "e1"}
    stats = runner.chat_stats()
    assert stats.decode_tokens == sum(p.max_tokens - 1 for p in params)
    assert stats.decode_forwards <= max(p.max_tokens for p in params) + len(params)  # not one per token
    assert not port.failed and set(port.jobs) == {"e0", "e1"}  # the encodes wait for their push


def test_an_aborted_chat_leaves_the_batch_and_sends_nothing_more(family):
    port = Port()
    runner = EncoderRunner(family, port)
    for i in range(2):
        runner.accept(wire.chat_to_wire(f"c{i}", 0, chat_params(i), stream=True))
    for _ in range(4):
        runner.execute()
    gone = port.jobs["c1"]
    runner.abort(gone)
    port.jobs.pop("c1")
    sent = len([m for m in port.sent if m.request_id == "c1"])
    runner.execute()
    assert len(runner.engine.batch) == 1
    while runner.has_work():
        runner.execute()
    assert len([m for m in port.sent if m.request_id == "c1"]) == sent
    assert [m.request_id for m in port.sent if isinstance(m, P.ChatDone)] == ["c0"]


def test_chats_taken_while_the_first_prompt_builds_prefill_together_in_the_first_forward(family):
    """Chats reach an encoder one control message apart (the head sends each when it is parsed).
    While none decodes, an ``execute()`` builds one waiting prompt and returns, so the worker loop
    takes the next chats before the first forward: all of them prefill in it and decode together
    (one decode forward per token for all), instead of the first one decoding alone while the
    others join a step at a time."""
    port = Port()
    runner = EncoderRunner(family, port, ChatEngineConfig(max_running_chats=8, prefix_cache_mb=0))
    params = [chat_params(i) for i in range(4)]
    runner.accept(wire.chat_to_wire("c0", 0, params[0], stream=False))
    runner.execute()  # the first chat's prompt builds: nothing has run the model for chats yet
    assert runner.engine.forwards == 0
    for i in range(1, 4):  # the next ones arrive meanwhile
        runner.accept(wire.chat_to_wire(f"c{i}", 0, params[i], stream=False))
    while runner.has_work():
        runner.execute()
    stats = runner.chat_stats()
    assert (stats.prefill_forwards, stats.prefill_rows) == (1, 4)
    assert stats.max_batch == 4
    assert stats.decode_forwards == max(p.max_tokens for p in params) - 1
    done = {m.request_id: m for m in port.sent if isinstance(m, P.ChatDone)}
    assert not any(isinstance(m, P.ChatDelta) for m in port.sent)  # nothing before a non-streamed answer ends
    for i, p in enumerate(params):
        alone = family.chat_model().run(p)
        assert (done[f"c{i}"].text, done[f"c{i}"].completion_tokens) == (alone.text, alone.completion_tokens)


def test_a_chat_s_stage_times_reach_the_head_on_its_chat_done_and_lie_before_its_first_token(family):
    """``ChatDone.timing``: the encoder layer's vision step and the prefill forward are disjoint
    intervals after the chat was taken and before its first token; a chat that joins while another
    decodes prefills in a mixed forward and is timed the same way."""
    port = Port()
    runner = EncoderRunner(family, port, ChatEngineConfig(prefix_cache_mb=0))
    runner.accept(wire.chat_to_wire("c0", 0, chat_params(0), stream=True))
    for _ in range(4):
        runner.execute()
    assert runner.engine.running  # c0 decodes: c1 joins it in a mixed forward
    runner.accept(wire.chat_to_wire("c1", 0, chat_params(1), stream=False))
    while runner.has_work():
        runner.execute()
    done = {m.request_id: m for m in port.sent if isinstance(m, P.ChatDone)}
    for rid in ("c0", "c1"):
        t = done[rid].timing
        assert t is not None and t.vision_s > 0 and t.prefill_s > 0 and t.queue_s >= 0, t
        assert t.queue_s + t.vision_s + t.prefill_s <= t.first_token_s < t.total_s, t
        assert t.head_queue_s == 0  # the head sets it
