"""The in-process backend's chats run in one batched chat engine (``control.inprocess_chat``): chats
asked together decode together and answer as each alone; streaming and cancel still work."""

from __future__ import annotations

import asyncio

import pytest

from shapeworld import render, sample_scenes
from triptych.chat import ChatParams, ChatTurn
from triptych.control.backend import Cancelled, ChatJob, InProcessBackend
from triptych.families.base import Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class


@pytest.fixture(scope="module")
def family():
    return family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER})


def ask(question, *images, **kw) -> ChatParams:
    return ChatParams((ChatTurn("user", (*range(len(images)), question)),), tuple(images), **kw)


def test_chats_asked_together_decode_in_one_batch_and_answer_as_alone(family):
    images = [render(s, 64) for s in sample_scenes(3, "in-process-chat-test", "heldout")]
    prompts = [ask("What is in this image?", im, max_tokens=12, ignore_eos=True) for im in images]
    backend = InProcessBackend(family)
    pieces: list[str] = []

    async def main():
        jobs = [ChatJob(f"c{i}", p, stream=i == 0) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(backend.chat(j, pieces.append if j.stream else None) for j in jobs))

    results = asyncio.run(main())
    model = family.chat_model()
    assert results == [model.run(p) for p in prompts]
    assert "".join(pieces) == results[0].text
    assert backend._chats.engine.stats.max_batch == 3  # one forward per token for all three


def test_a_cancelled_in_process_chat_ends_and_the_others_finish(family):
    backend = InProcessBackend(family)

    async def main():
        keep = asyncio.ensure_future(backend.chat(ChatJob("keep", ask("hi", max_tokens=30, ignore_eos=True), False)))
        drop = asyncio.ensure_future(backend.chat(ChatJob("drop", ask("hi", max_tokens=500, ignore_eos=True), True)))
        for _ in range(6000):  # both decode (a deadline of 60 s)
            if backend._chats is not None and len(backend._chats.engine.running) == 2:
                break
            await asyncio.sleep(0.01)
        assert await backend.cancel("drop")
        with pytest.raises(Cancelled):
            await asyncio.wait_for(drop, 60)
        return await asyncio.wait_for(keep, 60)

    result = asyncio.run(main())
    assert result.completion_tokens == 30 and result.finish_reason == "length"
