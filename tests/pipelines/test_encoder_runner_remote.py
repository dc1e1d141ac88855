"""Chats answered by a remote engine (vLLM) go through the encoder layer like built-in chats: with 8
chats and edits mixed (8 distinct images), the first ``execute()`` runs the vision tower once and
submits every chat (not one per step); each chat's embeddings equal its image encoded alone; the
layer's entries are released when a chat ends, fails or is aborted. The engine is a stand-in here
(``tests/e2e/test_chat_vllm.py`` runs the real one)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from tests.helpers import EncoderPort as Port
from tests.pipelines.test_encoder_layer import chat_task, drain, edit_task, images, load
from triptych.chat import ChatParams, ChatResult, ChatTurn
from triptych.control import protocol as P
from triptych.families.qwenimage.vllm import embedding_items
from triptych.vllm_chat.engine import ChatEvent
from triptych.worker.runners.encoder import EncoderRunner

QUESTION = "What is in this image?"


class Engine:
    """What ``RemoteChats`` asks of ``VllmChatEngine``, recording the bodies it is sent."""

    model, max_model_len = "default", 1024

    def __init__(self):
        self.bodies: dict[str, dict] = {}
        self.events: list[ChatEvent] = []
        self.cancelled: list[str] = []
        self.handovers = 0  # submit_all calls that carried chats

    def connect(self):
        pass

    def submit_all(self, chats):
        self.handovers += bool(chats)
        self.bodies.update(chats)

    def has_events(self):
        return bool(self.events)

    def poll(self):
        out, self.events = self.events, []
        return out

    def cancel(self, key):
        self.cancelled.append(key)

    def close(self):
        pass


def sent_embeds(body) -> torch.Tensor:
    (message,) = body["messages"]
    part = message["content"][0]
    return torch.from_numpy(np.load(io.BytesIO(base64.b64decode(part["image_embeds"]["image_embeds"]))))


def test_remote_chats_share_the_steps_batched_forward_and_are_all_sent_at_once():
    family, plain = load(), load(max_mb=0)
    engine = Engine()
    runner = EncoderRunner(family, Port(), chat_engine=engine)
    stats = family.mm_cache.stats
    forwards = stats.forwards
    pics = images(8, "encoder-remote-batch")
    for i, image in enumerate(pics):
        if i % 2:
            runner.accept(chat_task(f"chat-{i}", [image]))
        else:
            task, _ = edit_task(family, f"edit-{i}", image)
            runner.accept(task)
    runner.execute()  # one batched forward over all 8 images; every chat's images are in: all sent
    assert stats.forwards == forwards + 1
    assert sorted(engine.bodies) == [f"chat-{i}#1" for i in (1, 3, 5, 7)]
    assert engine.handovers == 1  # the four chats reach the engine's thread in one hand-over
    # each request holds its image until it ends: the chats (sent, answering) and three of the edits
    # (the step also ran the first edit's encode)
    assert family.mm_cache.store.holder_count() == 7
    drain(runner)
    assert stats.forwards == forwards + 1 and not runner.port.failed
    for i in (1, 3, 5, 7):
        alone = ChatParams((ChatTurn("user", (0, QUESTION)),), (pics[i],), max_tokens=4)
        _, items = embedding_items(plain.chat_model(), alone, "")  # the uuid is not compared
        torch.testing.assert_close(sent_embeds(engine.bodies[f"chat-{i}#1"]), items[0].image_embeds, rtol=0, atol=0)
    # the edits have finished: only the chats (still answering) hold their images
    assert family.mm_cache.store.holder_count() == 4
    engine.events = [
        ChatEvent("chat-1#1", result=ChatResult("a cube", 20, 4, "length")),
        ChatEvent("chat-3#1", error=RuntimeError("vLLM answered 500")),
    ]
    runner.execute()
    assert [m.request_id for m in runner.port.sent if isinstance(m, P.ChatDone)] == ["chat-1"]
    assert [rid for rid, _, _ in runner.port.failed] == ["chat-3"]
    runner.abort(runner.port.jobs["chat-5"])
    assert engine.cancelled == ["chat-5#1"]
    assert family.mm_cache.store.holder_count() == 1  # chat-7 still answering
    runner.close()
    assert family.mm_cache.store.holder_count() == 0 and runner.layer.pending() == 0
