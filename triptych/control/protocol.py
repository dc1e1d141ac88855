"""Control-plane messages between the head (orchestrator) and the role workers.

One ``msgspec.Struct`` per edge, encoded as msgpack with a tagged union: a frame decodes to exactly
one of these types or is rejected with ``ProtocolError``; nothing is ever unpickled. Tensors never
travel inside a message: a receiver reserves slots on its transfer endpoint and hands the sender
``TensorRef`` handles (``SlotsReserved`` → ``PushTask``); the bytes then move peer to peer.

Every request-scoped message carries ``request_id`` and ``generation`` (bumped on a retry elsewhere; an older
one's messages are dropped). The others are instance-scoped; registration is a challenge-response, ``Hello``
→ ``Challenge`` → ``Register`` → ``RegisterAck`` (freshness and the frame envelope: ``sessions``, ``auth``).

The handoff of tensors between two stages (conditioning encoder → denoiser, final latents
denoiser → decoder) is the same five messages each time::

    upstream ──EncodeDone/DenoiseDone(specs)──▶ head ──DenoiseTask/DecodeTask(specs, source)──▶ downstream
    downstream reserves a bundle ──SlotsReserved(refs)──▶ head ──PushTask(refs)──▶ upstream
    upstream pushes P2P, frees its copy ──PushDone──▶ head; downstream waits ready and runs

Previews (``partial_images``) are one more handoff of that shape per preview (``PreviewReady`` → ``PreviewTask``
→ ... → ``PreviewResult``); one that cannot move is dropped, never failing its request. A chat is one
encoder's work: ``ChatTask`` → ``ChatDelta``s → ``ChatDone`` or ``StageError`` (an embedding another
encoder holds moves peer to peer between the encoders, ``mm_remote``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from triptych.chat.stats import ChatEngineStats
from triptych.chat.timing import ChatTiming
from triptych.control.mm_hints import MMHint, MMImage
from triptych.control.protocol_chat import ChatMessage as ChatMessage
from triptych.control.protocol_chat import ChatPart as ChatPart
from triptych.control.protocol_chat import ChatTask
from triptych.core.errors import TriptychError
from triptych.core.kinds import Role, TransferKind
from triptych.engine.stats import EngineStats
from triptych.mmcache.stats import MMCacheStats
from triptych.plan.compute_stats import ComputeStats
from triptych.transfer.refs import TensorRef, TensorSpec
from triptych.transfer.stats import TransferStats

StageName = Literal["encode", "denoise", "decode", "chat"]
HandoffName = Literal["cond", "latents", "preview0", "preview1", "preview2"]  # what moves: cond, latents, a preview
PREVIEW_HANDOFFS = ("preview0", "preview1", "preview2")  # index k → its handoff name


class ProtocolError(TriptychError):
    """A frame that is not a well-formed control message (malformed, unknown tag, wrong fields)."""


class WireParams(msgspec.Struct, kw_only=True, frozen=True):
    """``GenerationParams`` after ``Family.resolve``, as plain wire types."""

    prompt: str
    negative_prompt: str | None  # None: no negative prompt
    height: int
    width: int
    frames: int | None  # None for image families that leave it unset
    steps: int
    guidance: float | None  # None: the family has no guidance scale
    seed: int
    image_png: bytes | None  # condition image as lossless PNG; None for text-only requests
    true_cfg: float
    teacache_threshold: float
    tenant: str = ""  # scopes the encoder's mm-hash cache (``GenerationParams.tenant``)
    lora: list[tuple[str, float]] = []  # the request's adapters and scales, in order; [] = none
    lora_paths: list[tuple[str, str]] = []  # weight files of its run-time adapters (loaded on a miss)
    priority: int = 0  # its priority class, lower sooner (``GenerationParams.priority``): the engine's batch order


# ---- worker → head ---------------------------------------------------------------------------
class Hello(msgspec.Struct, kw_only=True, frozen=True, tag="hello"):
    """A worker asks for a registration challenge; the head answers ``Challenge``."""

    instance_id: str


class Register(msgspec.Struct, kw_only=True, frozen=True, tag="register"):
    """A worker announces itself; the head answers ``RegisterAck``."""

    instance_id: str  # unique per worker process, chosen by the worker
    role: Role
    capacity: int  # requests this instance may hold at once (its slots)
    control: str  # the worker's control identity / address (rank 0 of the instance)
    data: str  # transfer endpoint address senders push to (rank 0)
    transfer: TransferKind  # the transfer backend actually running (ZMQ or MOONCAKE)
    revision: str  # hash of the model directory's configs; must equal the head's
    pid: int  # process id, for operators and tests
    chat: bool = False  # an encoder that also answers ``ChatTask`` (its text encoder is a VLM)
    #: ZMQ identities of this process's other sockets (its heartbeat's); no other socket speaks for it
    channels: tuple[bytes, ...] = ()
    chat_slots: int = 0  # chats it may hold apart from its slots (running + waiting); 0: each takes a slot


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True, tag="heartbeat"):
    """Periodic liveness + load report; an instance silent past the timeout is declared dead."""

    instance_id: str
    active: int  # requests this worker currently holds (any stage of its work)
    free_slots: int  # free receiver slots of its transfer pool
    max_slots: int  # receiver slots of its transfer pool
    engine_running: int  # denoiser: requests in the step-batching engine; 0 for other roles


class StatsReport(msgspec.Struct, kw_only=True, frozen=True, tag="stats_report"):
    """Periodic cumulative counters of a worker; the head turns consecutive reports into metric deltas."""

    instance_id: str
    uptime_s: float  # seconds since the worker started (its monotonic clock): rate windows, restarts
    engine: EngineStats | None  # the denoiser's engine; None for roles without one
    transfer: TransferStats  # its transfer endpoint
    mm_cache: MMCacheStats | None = None  # the encoder's mm-hash cache; None where there is none
    chat: ChatEngineStats | None = None  # the encoder's chat engine; None where it has not chatted
    compute: ComputeStats | None = None  # model FLOPs it executed and its devices' peak; None: not metered
    jobs: tuple[tuple[str, int], ...] = ()  # (request id, generation) it holds: the head cancels any it does not


class WorkerReply(msgspec.Struct, kw_only=True, frozen=True):
    """What every worker message about one request carries (an older ``generation`` is dropped)."""

    request_id: str
    generation: int
    instance_id: str


class EncodeDone(WorkerReply, kw_only=True, frozen=True, tag="encode_done"):
    """Conditioning is ready on the encoder and held there until ``PushTask`` arrives."""

    specs: dict[str, TensorSpec]  # ``Conditioning.flat()`` names → spec
    images: tuple[MMImage, ...] = ()  # the embeddings its condition image has here (cross-encoder hits)


class DenoiseDone(WorkerReply, kw_only=True, frozen=True, tag="denoise_done"):
    """Final latents are ready on the denoiser and held there until ``PushTask`` arrives."""

    specs: dict[str, TensorSpec]  # {"latents": spec}
    engine_s: float = 0.0  # seconds from joining the engine to its last step
    tick_s: float = 0.0  # mean seconds of the engine ticks that stepped it: the head's step costs (0: unknown)
    occupancy: float = 0.0  # mean requests stepped in those ticks (0: unknown)


class PreviewReady(WorkerReply, kw_only=True, frozen=True, tag="preview_ready"):
    """A preview's predicted clean latents are ready on the denoiser, held there until ``PushTask``
    (handoff ``PREVIEW_HANDOFFS[index]``) or until the request leaves the denoiser."""

    index: int  # 0-based preview number (OpenAI's partial_image_index)
    step: int  # steps done when it was taken
    total: int  # total steps
    specs: dict[str, TensorSpec]  # {"latents": spec}


class SlotsReserved(WorkerReply, kw_only=True, frozen=True, tag="slots_reserved"):
    """The downstream worker reserved receiver slots for a handoff; the head forwards the refs."""

    handoff: HandoffName
    refs: dict[str, TensorRef]  # one reserved slot per tensor name


class PushDone(WorkerReply, kw_only=True, frozen=True, tag="push_done"):
    """The upstream worker pushed every tensor of a handoff and freed its own copy."""

    handoff: HandoffName


class StepProgress(msgspec.Struct, kw_only=True, frozen=True):
    """One request's denoising steps after an engine tick."""

    request_id: str
    generation: int
    step: int  # steps done
    total: int  # total steps


class TickReport(msgspec.Struct, kw_only=True, frozen=True, tag="tick_report"):
    """One engine tick of a denoiser, once per tick: the steps of the requests the head follows
    (``DenoiseTask.progress``); not sent for a tick that advanced none of them."""

    instance_id: str
    progress: tuple[StepProgress, ...]


#: Largest control frame the head reads; a ``MediaResult``'s bytes stay below it by a MiB of envelope.
MAX_FRAME_BYTES = 256 << 20
MAX_MEDIA_BYTES = MAX_FRAME_BYTES - (1 << 20)


class MediaResult(WorkerReply, kw_only=True, frozen=True, tag="media_result"):
    """The decoder's encoded output (media bytes may pass through the head; tensors never do;
    at most ``MAX_MEDIA_BYTES``)."""

    data: bytes  # PNG/JPEG/WebP/MP4 bytes
    output_format: str


class PreviewResult(WorkerReply, kw_only=True, frozen=True, tag="preview_result"):
    """A decoded preview (media bytes, like ``MediaResult``), sent before the request's ``MediaResult``."""

    index: int  # 0-based preview number
    step: int  # steps done when it was taken
    total: int
    data: bytes  # PNG/JPEG/WebP bytes at the output size
    output_format: str


class ChatDelta(WorkerReply, kw_only=True, frozen=True, tag="chat_delta"):
    """The next piece of a chat answer, sent as it is decoded (streaming)."""

    text: str


class ChatDone(WorkerReply, kw_only=True, frozen=True, tag="chat_done"):
    """A chat answer is complete; ``text`` is the whole answer (the deltas concatenated)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length
    images: tuple[MMImage, ...] = ()  # the embeddings its images have on this encoder (cross-encoder hits)
    timing: ChatTiming | None = None  # its worker-side stage times (None: a remote engine that does not say)


class StageError(WorkerReply, kw_only=True, frozen=True, tag="stage_error"):
    """A stage failed on a worker; ``retryable`` says whether another instance may succeed."""

    stage: StageName
    kind: str  # exception class name, for logs and metrics
    message: str  # user-safe description
    retryable: bool
    #: (field, value, rule) of a rule only the worker can check (a chat prompt past the context): a 400
    invalid: tuple[str, str, str] | None = None


# ---- head → worker ---------------------------------------------------------------------------
class Challenge(msgspec.Struct, kw_only=True, frozen=True, tag="challenge"):
    """The answer to ``Hello``: seal the ``Register`` under ``nonce``, good once, for the asking socket."""

    instance_id: str
    nonce: bytes  # ``auth.SESSION_BYTES`` random bytes


class RegisterAck(msgspec.Struct, kw_only=True, frozen=True, tag="register_ack"):
    """Accept or refuse a ``Register`` (e.g. model revision mismatch)."""

    instance_id: str
    accepted: bool
    reason: str | None  # why it was refused; None when accepted
    heartbeat_interval_s: float  # how often the worker must send ``Heartbeat``


class EncodeTask(msgspec.Struct, kw_only=True, frozen=True, tag="encode_task"):
    """Encode one request; the conditioning will be pushed to ``denoiser``."""

    request_id: str
    generation: int
    params: WireParams
    denoiser: str  # instance id of the denoiser that will receive the conditioning
    mm_hints: tuple[MMHint, ...] = ()  # other encoders holding its image's embeddings (``mm_remote``)


class DenoiseTask(msgspec.Struct, kw_only=True, frozen=True, tag="denoise_task"):
    """Receive conditioning from ``source``, prepare, denoise; latents will go to ``decoder``."""

    request_id: str
    generation: int
    params: WireParams
    specs: dict[str, TensorSpec]  # conditioning tensors to reserve
    source: str  # encoder instance id (the only peer allowed to push into the slots)
    decoder: str  # decoder instance id already holding a slot for this request
    reserve_timeout_s: float  # how long the reserved slots wait for the push
    previews: int = 0  # partial images wanted: x0 previews at evenly spaced steps (``preview_steps``)
    progress: bool = False  # report its steps in each ``TickReport`` (someone follows this request's steps)


class DecodeTask(msgspec.Struct, kw_only=True, frozen=True, tag="decode_task"):
    """Receive final latents from ``source``, decode, encode media, answer ``MediaResult``."""

    request_id: str
    generation: int
    params: WireParams
    specs: dict[str, TensorSpec]
    source: str  # denoiser instance id
    output_format: str  # png | jpeg | webp | mp4
    fps: int
    reserve_timeout_s: float
    quality: int | None = None  # jpeg/webp quality; None: the encoder's default


class PreviewTask(msgspec.Struct, kw_only=True, frozen=True, tag="preview_task"):
    """Receive a preview's latents from ``source`` (the request's denoiser) into slots for ``handoff``, decode
    them like final latents, answer ``PreviewResult``. Sent to the request's decoder, before its ``DecodeTask``."""

    request_id: str
    generation: int
    params: WireParams
    index: int  # 0-based preview number; ``handoff`` is ``PREVIEW_HANDOFFS[index]``
    step: int
    total: int
    specs: dict[str, TensorSpec]
    source: str  # denoiser instance id
    output_format: str  # png | jpeg | webp
    quality: int | None  # jpeg/webp quality; None: the encoder's default
    reserve_timeout_s: float


class PushTask(msgspec.Struct, kw_only=True, frozen=True, tag="push_task"):
    """Push the held tensors of a handoff into the downstream slots ``refs``."""

    request_id: str
    generation: int
    handoff: HandoffName
    refs: dict[str, TensorRef]


class Cancel(msgspec.Struct, kw_only=True, frozen=True, tag="cancel"):
    """Drop everything held for this request generation: slots, held tensors, engine state."""

    request_id: str
    generation: int
    reason: str


class PeerDown(msgspec.Struct, kw_only=True, frozen=True, tag="peer_down"):
    """An instance was declared dead: reclaim every receiver slot reserved for it."""

    instance_id: str


class Shutdown(msgspec.Struct, kw_only=True, frozen=True, tag="shutdown"):
    """Stop the worker process cleanly."""

    reason: str


class Rejoin(msgspec.Struct, kw_only=True, frozen=True, tag="rejoin"):
    """The head heard from an instance it does not know (declared dead while it was only silent, or
    the head restarted): drop every job (the head retried them), then ``Register`` again."""

    reason: str


WorkerMessage = (
    Hello
    | Register
    | Heartbeat
    | StatsReport
    | EncodeDone
    | DenoiseDone
    | SlotsReserved
    | PushDone
    | TickReport
    | PreviewReady
    | PreviewResult
    | MediaResult
    | ChatDelta
    | ChatDone
    | StageError
)
HeadMessage = (
    Challenge
    | RegisterAck
    | EncodeTask
    | DenoiseTask
    | DecodeTask
    | PreviewTask
    | ChatTask
    | PushTask
    | Cancel
    | PeerDown
    | Shutdown
    | Rejoin
)
Message = WorkerMessage | HeadMessage

_ENCODER = msgspec.msgpack.Encoder()
_WORKER_DECODER = msgspec.msgpack.Decoder(WorkerMessage)
_HEAD_DECODER = msgspec.msgpack.Decoder(HeadMessage)
_ANY_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes | memoryview):
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"rejected control frame of {len(data)} bytes: {e}") from e


def decode_from_worker(data: bytes | memoryview) -> WorkerMessage:
    """Decode a frame the head received; raises ``ProtocolError`` for anything else."""
    return _decode(_WORKER_DECODER, data)


def decode_from_head(data: bytes | memoryview) -> HeadMessage:
    """Decode a frame a worker received; raises ``ProtocolError`` for anything else."""
    return _decode(_HEAD_DECODER, data)


def decode_any(data: bytes | memoryview) -> Message:
    return _decode(_ANY_DECODER, data)
