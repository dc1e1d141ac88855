"""Chat routing on the head against scripted fake encoders (raw ZMQ sockets): only chat-capable
encoders get chats, pieces reach the caller in order, a worker's death before any piece retries the
chat elsewhere (after one it fails, never restarting an answer the client has half seen), a
worker-side rule break is the user's error, and a cancel reaches the worker and frees its slot."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from tests.e2e.http_support import wait_for
from triptych.chat import ChatParams, ChatTurn
from triptych.chat.timing import ChatTiming
from triptych.control import protocol as P
from triptych.control.auth import ControlKey
from triptych.control.backend import Cancelled, ChatJob, StageFailed
from triptych.control.orchestrator import Orchestrator, OrchestratorConfig
from triptych.core.errors import InvalidParam
from triptych.families.models import PACKAGED_DEFAULT
from triptych.worker.control_client import ControlClient

MODEL = PACKAGED_DEFAULT.parent / "default_edit"
PARAMS = ChatParams((ChatTurn("user", ("hello",)),), max_tokens=8)


@pytest.fixture
def head():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    orch = Orchestrator(MODEL, OrchestratorConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=60.0))
    asyncio.run_coroutine_threadsafe(orch.start(), loop).result(30)
    ctx = zmq.Context()
    yield orch, loop, ctx
    asyncio.run_coroutine_threadsafe(orch.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    ctx.destroy(linger=0)


class Encoder:
    def __init__(
        self, ctx, head: Orchestrator, instance_id: str, chat: bool, role: str = "encoder", chat_slots: int = 0
    ):
        self.id = instance_id
        self.key = ControlKey(head.token)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, instance_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(head.control_address)
        self.client = ControlClient(self.sock, self.key)
        register = P.Register(
            instance_id=instance_id,
            role=role,
            capacity=2,
            control=instance_id,
            data="tcp://127.0.0.1:1",
            transfer="zmq",
            revision=head.revision,
            pid=1,
            chat=chat,
            chat_slots=chat_slots,
        )
        assert self.client.register(register, 30.0, on_skipped=print).accepted

    def send(self, msg) -> None:
        self.client.send(msg)

    def recv(self, timeout_s: float = 30.0):
        assert self.sock.poll(timeout_s * 1000), f"{self.id}: no message from the head"
        return self.client.recv()

    def next(self, kind: type):
        """The next message of ``kind`` (skipping others: PeerDown, the Cancel that follows a failure)."""
        while not isinstance(msg := self.recv(), kind):
            pass
        return msg

    def silent(self, timeout_s: float = 0.3) -> bool:
        return not self.sock.poll(timeout_s * 1000)

    def close(self) -> None:
        self.sock.close(0)


def start_chat(loop, orch, rid: str, pieces: list[str], stream: bool = True):
    def on_text(text: str) -> None:
        pieces.append(text)

    return asyncio.run_coroutine_threadsafe(orch.chat(ChatJob(rid, PARAMS, stream), on_text), loop)


def described(loop, orch) -> dict:
    async def read():
        return orch.describe()

    return asyncio.run_coroutine_threadsafe(read(), loop).result(10)


def held(loop, orch) -> dict[str, list[str]]:
    async def read():
        return {i["id"]: i["held"] for i in orch.describe()["instances"]}

    return asyncio.run_coroutine_threadsafe(read(), loop).result(10)


def test_chat_goes_to_a_chat_capable_encoder_and_streams_in_order(head):
    orch, loop, ctx = head
    plain, vlm = Encoder(ctx, orch, "enc-a", chat=False), Encoder(ctx, orch, "enc-b", chat=True)
    pieces: list[str] = []
    future = start_chat(loop, orch, "c1", pieces)
    task = vlm.recv()
    assert isinstance(task, P.ChatTask) and task.stream and task.messages[0].parts[0].text == "hello"
    assert plain.silent()
    for text in ("a", " red", " circle"):
        vlm.send(P.ChatDelta(request_id="c1", generation=task.generation, instance_id="enc-b", text=text))
    vlm.send(
        P.ChatDone(
            request_id="c1",
            generation=task.generation,
            instance_id="enc-b",
            text="a red circle",
            prompt_tokens=20,
            completion_tokens=4,
            finish_reason="stop",
        )
    )
    result = future.result(30)
    assert (result.text, result.prompt_tokens, result.completion_tokens, result.finish_reason) == (
        "a red circle",
        20,
        4,
        "stop",
    )
    assert pieces == ["a", " red", " circle"]
    assert held(loop, orch) == {"enc-a": [], "enc-b": []}


def test_chats_take_the_encoders_chat_slots_not_its_encode_slots(head):
    """An encoder with 2 encode slots advertising 8 chat slots gets 8 chats at once (the 9th waits for
    one to end); one without chat slots (an older worker) takes chats in its 2 encode slots."""
    orch, loop, ctx = head
    vlm = Encoder(ctx, orch, "enc-a", chat=True, chat_slots=8)
    futures = [start_chat(loop, orch, f"c{i}", []) for i in range(9)]
    tasks = [vlm.next(P.ChatTask) for _ in range(8)]
    assert vlm.silent()  # the 9th waits
    ids = {t.request_id for t in tasks}
    state = described(loop, orch)
    assert len(ids) == 8 and state["queues"]["chat"] == 1
    (inst,) = [i for i in state["instances"] if i["id"] == "enc-a"]
    assert (inst["free"], inst["chat_free"]) == (2, 0)  # encodes still have both slots
    first = tasks[0]
    vlm.send(
        P.ChatDone(
            request_id=first.request_id,
            generation=first.generation,
            instance_id="enc-a",
            text="ok",
            prompt_tokens=5,
            completion_tokens=1,
            finish_reason="stop",
        )
    )
    ninth = vlm.next(P.ChatTask)
    assert ninth.request_id not in ids
    for t in (*tasks[1:], ninth):
        vlm.send(
            P.ChatDone(
                request_id=t.request_id,
                generation=t.generation,
                instance_id="enc-a",
                text="ok",
                prompt_tokens=5,
                completion_tokens=1,
                finish_reason="stop",
            )
        )
    assert all(f.result(30).text == "ok" for f in futures)

    old = Encoder(ctx, orch, "enc-b", chat=True)
    vlm.close()
    loop.call_soon_threadsafe(orch.instance_dead, "enc-a", "test: gone")
    wait_for(lambda: "enc-a" not in held(loop, orch), "enc-a forgotten")
    futures = [start_chat(loop, orch, f"d{i}", []) for i in range(3)]
    tasks = [old.next(P.ChatTask) for _ in range(2)]
    assert old.silent()  # two encode slots: the third chat waits
    for t in tasks:
        old.send(
            P.ChatDone(
                request_id=t.request_id,
                generation=t.generation,
                instance_id="enc-b",
                text="ok",
                prompt_tokens=5,
                completion_tokens=1,
                finish_reason="stop",
            )
        )
    last = old.next(P.ChatTask)
    old.send(
        P.ChatDone(
            request_id=last.request_id,
            generation=last.generation,
            instance_id="enc-b",
            text="ok",
            prompt_tokens=5,
            completion_tokens=1,
            finish_reason="stop",
        )
    )
    assert all(f.result(30).text == "ok" for f in futures)


def test_a_dead_encoder_before_any_piece_retries_elsewhere_after_one_fails(head):
    orch, loop, ctx = head
    first, second = Encoder(ctx, orch, "enc-a", chat=True), Encoder(ctx, orch, "enc-b", chat=True)
    future = start_chat(loop, orch, "c1", [])
    workers = {w.id: w for w in (first, second)}
    got = {}
    for w in workers.values():
        if not w.silent(1.0):
            got[w.id] = w.recv()
    ((victim, task),) = got.items()
    other = next(w for w in workers.values() if w.id != victim)
    loop.call_soon_threadsafe(orch.instance_dead, victim, "test: killed")
    retry = other.next(P.ChatTask)  # after a PeerDown about the victim
    assert retry.generation == task.generation + 1
    other.send(
        P.ChatDone(
            request_id="c1",
            generation=task.generation,
            instance_id=other.id,
            text="stale",
            prompt_tokens=1,
            completion_tokens=1,
            finish_reason="stop",
        )
    )  # an older generation: dropped
    other.send(
        P.ChatDone(
            request_id="c1",
            generation=retry.generation,
            instance_id=other.id,
            text="fine",
            prompt_tokens=20,
            completion_tokens=2,
            finish_reason="stop",
        )
    )
    assert future.result(30).text == "fine"

    pieces: list[str] = []
    future = start_chat(loop, orch, "c2", pieces)
    task = other.next(P.ChatTask)
    other.send(P.ChatDelta(request_id="c2", generation=task.generation, instance_id=other.id, text="half"))
    wait_for(lambda: pieces == ["half"], "the piece reached the caller")
    loop.call_soon_threadsafe(orch.instance_dead, other.id, "test: killed")
    with pytest.raises(StageFailed, match="part of the answer was sent"):
        future.result(30)
    assert pieces == ["half"]


def test_worker_side_rule_break_is_the_users_error_and_cancel_frees_the_slot(head):
    orch, loop, ctx = head
    vlm = Encoder(ctx, orch, "enc-a", chat=True)
    future = start_chat(loop, orch, "c1", [], stream=False)
    task = vlm.recv()
    assert not task.stream
    vlm.send(
        P.StageError(
            request_id="c1",
            generation=task.generation,
            instance_id="enc-a",
            stage="chat",
            kind="InvalidParam",
            message="x",
            retryable=False,
            invalid=("max_tokens", "4096", "must fit the model's context of 4096 tokens"),
        )
    )
    with pytest.raises(InvalidParam) as e:
        future.result(30)
    assert e.value.field == "max_tokens" and "context" in e.value.rule

    future = start_chat(loop, orch, "c2", [])
    task = vlm.next(P.ChatTask)
    asyncio.run_coroutine_threadsafe(orch.cancel("c2"), loop).result(10)
    with pytest.raises(Cancelled):
        future.result(30)
    cancel = vlm.next(P.Cancel)
    assert isinstance(cancel, P.Cancel) and cancel.request_id == "c2" and cancel.generation == task.generation
    assert held(loop, orch) == {"enc-a": []}


def test_a_model_without_a_vlm_refuses_chat(tiny_model_dir):
    orch = Orchestrator(tiny_model_dir("flux"), OrchestratorConfig())

    async def go():
        await orch.start()
        try:
            await orch.chat(ChatJob("c1", PARAMS))
        finally:
            await orch.close()

    with pytest.raises(InvalidParam) as e:
        asyncio.run(go())
    assert e.value.field == "model"


def test_chats_waiting_for_an_encoder_count_in_the_encoder_pools_load(head):
    """The autoscaler grows the encoder pool from ``Orchestrator.load("encoder")``: chats queued for
    a chat-capable encoder slot count there (a plain encoder's free slots do not serve them)."""
    orch, loop, ctx = head
    plain, vlm = Encoder(ctx, orch, "enc-a", chat=False), Encoder(ctx, orch, "enc-b", chat=True)
    futures = [start_chat(loop, orch, f"c{i}", []) for i in range(3)]  # capacity 2: one waits
    tasks = [vlm.next(P.ChatTask) for _ in range(2)]
    load = asyncio.run_coroutine_threadsafe(_load(orch), loop).result(10)
    assert (load.queue_depth, load.live) == (1, ("enc-a", "enc-b")) and 0 <= load.oldest_wait_s < 30
    for task in tasks:
        vlm.send(
            P.ChatDone(
                request_id=task.request_id,
                generation=task.generation,
                instance_id="enc-b",
                text="ok",
                prompt_tokens=1,
                completion_tokens=1,
                finish_reason="stop",
            )
        )
    third = vlm.next(P.ChatTask)
    deadline = time.monotonic() + 30
    while (
        load := asyncio.run_coroutine_threadsafe(_load(orch), loop).result(10)
    ).queue_depth and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load.queue_depth == 0 and load.oldest_wait_s == 0.0
    vlm.send(
        P.ChatDone(
            request_id=third.request_id,
            generation=third.generation,
            instance_id="enc-b",
            text="ok",
            prompt_tokens=1,
            completion_tokens=1,
            finish_reason="stop",
        )
    )
    assert [f.result(30).text for f in futures] == ["ok"] * 3
    plain.close()


async def _load(orch):
    return orch.load("encoder", time.monotonic())


def test_image_affinity_sends_an_image_back_to_the_encoder_that_holds_it_within_its_tenant(head):
    """Image affinity: a second chat about an image goes to the encoder the first one went to (where
    its processor outputs and embeddings are), though the policy alone would alternate; the same
    image of another tenant is not steered; a busy or gone holder leaves the policy to choose."""
    import numpy as np
    from PIL import Image

    orch, loop, ctx = head
    workers = {w.id: w for w in (Encoder(ctx, orch, "enc-a", chat=True), Encoder(ctx, orch, "enc-b", chat=True))}
    picture = Image.fromarray((np.random.RandomState(3).rand(32, 32, 3) * 255).astype("uint8"))

    def chat(rid, tenant, image):
        params = ChatParams((ChatTurn("user", (0, "what is it?")),), (image,), max_tokens=4, tenant=tenant)
        future = asyncio.run_coroutine_threadsafe(orch.chat(ChatJob(rid, params, False), lambda t: None), loop)
        for w in workers.values():  # whoever got it answers
            if not w.silent(1.0):
                task = w.next(P.ChatTask)
                w.send(
                    P.ChatDone(
                        request_id=rid,
                        generation=task.generation,
                        instance_id=w.id,
                        text="ok",
                        prompt_tokens=20,
                        completion_tokens=1,
                        finish_reason="stop",
                    )
                )
                future.result(30)
                return w.id
        raise AssertionError("no encoder got the chat")

    first = chat("c1", "t1", picture)
    assert chat("c2", "t1", picture.copy()) == first  # the same pixels, another object
    assert chat("c3", "t1", picture) == first
    preferred = orch.registry.affinity.preferred
    chat("c4", "t2", picture)  # another tenant: its own key, which no encoder holds yet
    assert orch.registry.affinity.preferred == preferred
    loop.call_soon_threadsafe(orch.instance_dead, first, "test: gone")
    wait_for(lambda: first not in held(loop, orch), "the holder to leave")
    workers.pop(first).close()
    (other,) = workers
    assert chat("c5", "t1", picture) == other  # the holder is gone: the policy chooses


def test_an_edit_of_an_image_goes_to_the_encoder_already_encoding_it(head):
    """Image affinity for generations: a second edit of the same condition image goes to the encoder
    the first went to, though that one has fewer free slots (the policy alone would pick the other)."""
    import numpy as np
    from PIL import Image

    from triptych.control.backend import GenerationJob
    from triptych.families.base import GenerationParams

    orch, loop, ctx = head
    workers = [Encoder(ctx, orch, i, chat=True) for i in ("enc-a", "enc-b")]
    Encoder(ctx, orch, "den-0", chat=False, role="denoiser"), Encoder(ctx, orch, "dec-0", chat=False, role="decoder")
    picture = Image.fromarray((np.random.RandomState(5).rand(64, 64, 3) * 255).astype("uint8"))
    params = orch.family.resolve(GenerationParams("make it red", image=picture, seed=0))
    got = {}
    futures = []
    for rid in ("e1", "e2"):
        job = GenerationJob(rid, params.replace(image=picture.copy()), "png")
        futures.append(asyncio.run_coroutine_threadsafe(orch.run(job), loop))
        got[rid] = next(w.id for w in workers if not w.silent(2.0) and isinstance(w.next(P.EncodeTask), P.EncodeTask))
    assert got["e1"] == got["e2"]
    for rid, future in zip(("e1", "e2"), futures):
        asyncio.run_coroutine_threadsafe(orch.cancel(rid), loop).result(10)
        with pytest.raises(Cancelled):
            future.result(30)


def test_the_worker_s_stage_times_reach_the_answer_with_the_head_s_queue_time(head):
    """A chat that waited at the head for a chat-capable encoder carries that wait in its answer's
    ``timing.head_queue_s`` (at least the time before the encoder registered), beside the worker's
    stage times as the worker sent them."""
    orch, loop, ctx = head
    future = start_chat(loop, orch, "c1", [], stream=False)
    wait_for(lambda: described(loop, orch)["queues"]["chat"] == 1, "the chat in the head's queue")
    time.sleep(0.2)  # no chat-capable encoder yet: it waits at the head
    vlm = Encoder(ctx, orch, "enc-b", chat=True)
    task = vlm.next(P.ChatTask)
    worker = ChatTiming(queue_s=0.5, vision_s=0.25, prefill_s=1.0, first_token_s=2.0, total_s=3.0)
    vlm.send(
        P.ChatDone(
            request_id="c1",
            generation=task.generation,
            instance_id="enc-b",
            text="a",
            prompt_tokens=20,
            completion_tokens=1,
            finish_reason="stop",
            timing=worker,
        )
    )
    timing = future.result(30).timing
    assert timing.head_queue_s >= 0.2  # it was queued before the sleep and dispatched after it
    assert msgspec.structs.replace(timing, head_queue_s=0.0) == worker
