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
ENGINE = EngineStats(
    steps=10,
    forwards=12,
    rows=24,
    request_steps=30,
    skipped_rows=2,
    step_seconds=0.5,
    step_buckets=[0, 3, 7] + [0] * 14,
    batch_sizes={1: 4, 3: 6},
    finished=5,
    aborted=1,
)
TRANSFER = TransferStats(
    backend="zmq",
    pushes_sent=5,
    bytes_sent=4096,
    push_seconds=0.02,
    pushes_received=3,
    bytes_received=2048,
    push_buckets=[1, 4] + [0] * 11,
)

MESSAGES = [
    P.Register(
        instance_id="enc-0",
        role="encoder",
        capacity=4,
        control="enc-0",
        data="tcp://127.0.0.1:1",
        transfer="zmq",
        revision="abc",
        pid=123,
    ),
    P.Heartbeat(instance_id="den-0", active=1, free_slots=63, max_slots=64, engine_running=1),
    P.StatsReport(instance_id="den-0", uptime_s=12.5, engine=ENGINE, transfer=TRANSFER),
    P.StatsReport(instance_id="enc-0", uptime_s=3.0, engine=None, transfer=TRANSFER),
    P.EncodeDone(request_id="r1", generation=1, instance_id="enc-0", specs=SPEC),
    P.DenoiseDone(request_id="r1", generation=2, instance_id="den-0", specs=SPEC),
    P.SlotsReserved(
        request_id="r1", generation=1, instance_id="den-0", handoff="cond", refs={"cond.prompt_embeds": REF}
    ),
    P.PushDone(request_id="r1", generation=1, instance_id="enc-0", handoff="latents"),
    P.TickReport(
        instance_id="den-0",
        progress=(
            P.StepProgress(request_id="r1", generation=1, step=2, total=4),
            P.StepProgress(request_id="r2", generation=3, step=1, total=20),
        ),
    ),
    P.MediaResult(request_id="r1", generation=1, instance_id="dec-0", data=b"\x89PNG...", output_format="png"),
    P.PreviewReady(request_id="r1", generation=1, instance_id="den-0", index=0, step=2, total=4, specs=SPEC),
    P.PreviewResult(
        request_id="r1",
        generation=1,
        instance_id="dec-0",
        index=1,
        step=3,
        total=4,
        data=b"\x89PNG...",
        output_format="png",
    ),
    P.SlotsReserved(request_id="r1", generation=1, instance_id="dec-0", handoff="preview2", refs={"latents": REF}),
    P.StageError(
        request_id="r1",
        generation=1,
        instance_id="dec-0",
        stage="decode",
        kind="RuntimeError",
        message="boom",
        retryable=False,
    ),
    P.StageError(
        request_id="c1",
        generation=0,
        instance_id="enc-0",
        stage="chat",
        kind="InvalidParam",
        message="too long",
        retryable=False,
        invalid=("max_tokens", "4096", "fit the context"),
    ),
    P.Register(
        instance_id="enc-1",
        role="encoder",
        capacity=4,
        control="enc-1",
        data="tcp://127.0.0.1:2",
        transfer="zmq",
        revision="abc",
        pid=124,
        chat=True,
    ),
    P.ChatDelta(request_id="c1", generation=0, instance_id="enc-0", text=" circle"),
    P.ChatDone(
        request_id="c1",
        generation=0,
        instance_id="enc-0",
        text="a red circle",
        prompt_tokens=43,
        completion_tokens=12,
        finish_reason="stop",
    ),
    P.ChatTask(
        request_id="c1",
        generation=0,
        messages=[P.ChatMessage(role="user", parts=[P.ChatPart(image=0), P.ChatPart(text="hi")])],
        images_png=[b"\x89PNG"],
        max_tokens=16,
        temperature=0.0,
        top_p=1.0,
        seed=5,
        stream=True,
    ),
    P.RegisterAck(instance_id="enc-0", accepted=False, reason="revision differs", heartbeat_interval_s=0.5),
    P.EncodeTask(request_id="r1", generation=1, params=WIRE, denoiser="den-0"),
    P.DenoiseTask(
        request_id="r1", generation=1, params=WIRE, specs=SPEC, source="enc-0", decoder="dec-0", reserve_timeout_s=30.0
    ),
    P.DenoiseTask(
        request_id="r1",
        generation=1,
        params=WIRE,
        specs=SPEC,
        source="enc-0",
        decoder="dec-0",
        reserve_timeout_s=30.0,
        previews=3,
    ),
    P.DenoiseTask(
        request_id="r1",
        generation=1,
        params=WIRE,
        specs=SPEC,
        source="enc-0",
        decoder="dec-0",
        reserve_timeout_s=30.0,
        progress=True,
    ),
    P.PreviewTask(
        request_id="r1",
        generation=1,
        params=WIRE,
        index=1,
        step=3,
        total=4,
        specs=SPEC,
        source="den-0",
        output_format="webp",
        quality=80,
        reserve_timeout_s=30.0,
    ),
    P.PushTask(request_id="r1", generation=1, handoff="preview0", refs={"latents": REF}),
    P.DecodeTask(
        request_id="r1",
        generation=1,
        params=WIRE,
        specs=SPEC,
        source="den-0",
        output_format="png",
        fps=16,
        reserve_timeout_s=30.0,
    ),
    P.PushTask(request_id="r1", generation=1, handoff="cond", refs={"x": REF}),
    P.Cancel(request_id="r1", generation=3, reason="client disconnected"),
    P.PeerDown(instance_id="den-1"),
    P.Shutdown(reason="bye"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert P.decode_any(P.encode(msg)) == msg


def test_direction_is_enforced():
    with pytest.raises(P.ProtocolError):
        P.decode_from_worker(P.encode(P.Cancel(request_id="r1", generation=1, reason="x")))
    with pytest.raises(P.ProtocolError):
        P.decode_from_head(
            P.encode(P.Heartbeat(instance_id="den-0", active=1, free_slots=1, max_slots=1, engine_running=0))
        )


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode({"type": "no_such_message", "request_id": "r1"}),
        msgspec.msgpack.encode({"type": "cancel", "request_id": "r1"}),  # generation missing
        msgspec.msgpack.encode({"type": "cancel", "request_id": "r1", "generation": "1", "reason": "x"}),
        msgspec.msgpack.encode(["cancel", "r1", 1, "x"]),
        pickle.dumps(P.Shutdown(reason="x")),
    ],
)
def test_malformed_or_unknown_frames_are_rejected(frame):
    with pytest.raises(P.ProtocolError):
        P.decode_any(frame)


def test_a_preview_handoff_past_the_third_is_rejected():
    frame = P.encode(P.PushTask(request_id="r1", generation=1, handoff="preview2", refs={}))
    with pytest.raises(P.ProtocolError):
        P.decode_from_head(frame.replace(b"preview2", b"preview3"))


def test_params_round_trip_including_image():
    image = Image.new("RGB", (8, 8), (10, 20, 30))
    params = GenerationParams("x", "neg", 32, 48, 1, 3, 2.5, 9, image, 1.5, 0.1, priority=-4)
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
