"""The head → encoder chat task (``protocol``'s ``ChatTask``, re-exported there): a chat's turns, its
images as lossless PNGs, its sampling settings, and the hints of other encoders holding its images."""

from __future__ import annotations

import msgspec

from triptych.control.mm_hints import MMHint


class ChatPart(msgspec.Struct, kw_only=True, frozen=True):
    """A text, or the index of one of ``ChatTask.images``."""

    text: str | None = None
    image: int | None = None


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True):
    role: str  # system | user | assistant
    parts: list[ChatPart]


class ChatTask(msgspec.Struct, kw_only=True, frozen=True, tag="chat_task"):
    """Answer a chat with the encoder's VLM; reply with ``ChatDelta``s, then ``ChatDone`` or ``StageError``."""

    request_id: str
    generation: int
    messages: list[ChatMessage]
    images_png: list[bytes]  # lossless PNGs, referenced by ``ChatPart.image``
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int
    stream: bool  # send ChatDelta messages as the answer is decoded
    ignore_eos: bool = False  # generate exactly max_tokens
    tenant: str = ""  # scopes the encoder's mm-hash cache (``GenerationParams.tenant``)
    mm_hints: tuple[MMHint, ...] = ()  # other encoders holding its images' embeddings (``mm_remote``)
