"""Control messages round-trip through msgpack; anything malformed is rejected, never unpickled."""

from __future__ import annotations

import pickle

import msgspec
import pytest
from PIL import Image

from triptych.control import protocol as P
from triptych.control import wire
from triptych.engine.stats import EngineStats
from triptych.families.base import GenerationParams
from triptych.transfer.refs import MooncakeLocation, TensorRef
from triptych.transfer.stats import TransferStats

REF = TensorRef(
    "r1/g1/cond/cond.prompt_embeds",
    "float32",
    (1, 4, 8),
    128,
    "den-0",
    3,
    "tcp://127.0.0.1:5000",
    MooncakeLocation("127.0.0.1:1234", 4096),
)
WIRE = wire.params_to_wire(GenerationParams("a cat", height=32, width=32, frames=1, steps=2, guidance=3.5, seed=7))
SPEC = {"latents": P.TensorSpec("float32", (1, 16, 64))}
ENGINE = EngineStats(10, 12, 24, 30, 2, 0.5, {1: 4, 3: 6}, 5, 1)
TRANSFER = TransferStats("zmq", 5, 4096, 0.02, 3, 2048, 0, 0)

MESSAGES = [
    P.Register("enc-0", "encoder", 4, "enc-0", "tcp://127.0.0.1:1", "zmq", "abc", 123),
    P.Heartbeat("den-0", 1, 63, 64, 1),
    P.StatsReport("den-0", 12.5, ENGINE, TRANSFER),
    P.StatsReport("enc-0", 3.0, None, TRANSFER),
    P.EncodeDone("r1", 1, "enc-0", SPEC),
    P.DenoiseDone("r1", 2, "den-0", SPEC),
    P.SlotsReserved("r1", 1, "den-0", "cond", {"cond.prompt_embeds": REF}),
    P.PushDone("r1", 1, "enc-0", "latents"),
    P.Progress("r1", 1, "den-0", 2, 4),
    P.MediaResult("r1", 1, "dec-0", b"\x89PNG...", "png"),
    P.PreviewReady("r1", 1, "den-0", 0, 2, 4, SPEC),
    P.PreviewResult("r1", 1, "dec-0", 1, 3, 4, b"\x89PNG...", "png"),
    P.SlotsReserved("r1", 1, "dec-0", "preview2", {"latents": REF}),
    P.StageError("r1", 1, "dec-0", "decode", "RuntimeError", "boom", False),
    P.StageError(
        "c1", 0, "enc-0", "chat", "InvalidParam", "too long", False, ("max_tokens", "4096", "fit the context")
    ),
    P.Register("enc-1", "encoder", 4, "enc-1", "tcp://127.0.0.1:2", "zmq", "abc", 124, True),
    P.ChatDelta("c1", 0, "enc-0", " circle"),
    P.ChatDone("c1", 0, "enc-0", "a red circle", 43, 12, "stop"),
    P.ChatTask(
        "c1",
        0,
        [P.ChatMessage("user", [P.ChatPart(image=0), P.ChatPart(text="hi")])],
        [b"\x89PNG"],
        16,
        0.0,
        1.0,
        5,
        True,
    ),
    P.RegisterAck("enc-0", False, "revision differs", 0.5),
    P.EncodeTask("r1", 1, WIRE, "den-0"),
    P.DenoiseTask("r1", 1, WIRE, SPEC, "enc-0", "dec-0", 30.0),
    P.DenoiseTask("r1", 1, WIRE, SPEC, "enc-0", "dec-0", 30.0, previews=3),
    P.DenoiseTask("r1", 1, WIRE, SPEC, "enc-0", "dec-0", 30.0, progress=True),
    P.PreviewTask("r1", 1, WIRE, 1, 3, 4, SPEC, "den-0", "webp", 80, 30.0),
    P.PushTask("r1", 1, "preview0", {"latents": REF}),
    P.DecodeTask("r1", 1, WIRE, SPEC, "den-0", "png", 16, 30.0),
    P.PushTask("r1", 1, "cond", {"x": REF}),
    P.Cancel("r1", 3, "client disconnected"),
    P.PeerDown("den-1"),
    P.Shutdown("bye"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert P.decode_any(P.encode(msg)) == msg


def test_direction_is_enforced():
    with pytest.raises(P.ProtocolError):
        P.decode_from_worker(P.encode(P.Cancel("r1", 1, "x")))
    with pytest.raises(P.ProtocolError):
        P.decode_from_head(P.encode(P.Heartbeat("den-0", 1, 1, 1, 0)))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode({"type": "no_such_message", "request_id": "r1"}),
        msgspec.msgpack.encode({"type": "cancel", "request_id": "r1"}),  # generation missing
        msgspec.msgpack.encode({"type": "cancel", "request_id": "r1", "generation": "1", "reason": "x"}),
        msgspec.msgpack.encode(["cancel", "r1", 1, "x"]),
        pickle.dumps(P.Shutdown("x")),
    ],
)
def test_malformed_or_unknown_frames_are_rejected(frame):
    with pytest.raises(P.ProtocolError):
        P.decode_any(frame)


def test_a_preview_handoff_past_the_third_is_rejected():
    frame = P.encode(P.PushTask("r1", 1, "preview2", {}))
    with pytest.raises(P.ProtocolError):
        P.decode_from_head(frame.replace(b"preview2", b"preview3"))


def test_params_round_trip_including_image():
    image = Image.new("RGB", (8, 8), (10, 20, 30))
    params = GenerationParams("x", "neg", 32, 48, 1, 3, 2.5, 9, image, 1.5, 0.1)
    back = wire.params_from_wire(
        msgspec.msgpack.decode(msgspec.msgpack.encode(wire.params_to_wire(params)), type=P.WireParams)
    )
    assert back.replace(image=None) == params.replace(image=None)
    assert back.image.tobytes() == image.tobytes()


def test_chat_params_round_trip_including_images_in_order():
    from triptych.chat import ChatParams, ChatTurn

    images = (Image.new("RGB", (8, 8), (10, 20, 30)), Image.new("RGB", (4, 6), (1, 2, 3)))
    params = ChatParams(
        (ChatTurn("system", ("be brief",)), ChatTurn("user", (1, "and", 0, "?"))), images, 7, 0.7, 0.9, 11, True
    )
    task = P.decode_from_head(P.encode(wire.chat_to_wire("c1", 2, params, stream=True)))
    assert task.stream and task.generation == 2
    back = wire.chat_from_wire(task)
    assert (back.turns, back.max_tokens, back.temperature, back.top_p, back.seed, back.ignore_eos) == (
        params.turns,
        7,
        0.7,
        0.9,
        11,
        True,
    )
    assert [im.tobytes() for im in back.images] == [im.tobytes() for im in images]
