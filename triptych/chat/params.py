"""A chat request and its answer as plain values (``ChatParams``, ``ChatTurn``, ``ChatResult``): what the
head checks and the backends carry. No torch here: the head imports them (``triptych.chat.vlm`` runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from triptych.chat.timing import ChatTiming
from triptych.core.chat_sampling import ChatSampling
from triptych.core.errors import InvalidParam

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTurn:
    """One message: ``parts`` in order, each a text (str) or the index of an image in ``ChatParams.images``."""

    role: str
    parts: tuple[str | int, ...]


#: Temperatures below this decode greedily (``generation_config``).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class ChatParams:
    turns: tuple[ChatTurn, ...]
    images: tuple[Any, ...] = ()  # PIL images, referenced by index from the turns
    max_tokens: int = ChatSampling.max_tokens
    temperature: float = ChatSampling.temperature  # 0 (or below GREEDY_BELOW): greedy
    top_p: float = ChatSampling.top_p
    seed: int = ChatSampling.seed
    ignore_eos: bool = False  # generate exactly max_tokens (load tests, benchmarks)
    tenant: str = ""  # who asked (a hash of the API key at the head); scopes the mm-hash cache

    def check(self, max_images: int) -> None:
        """Structure only (the head runs it without the model); token counts are checked by ``ChatModel``."""
        if not self.turns:
            raise InvalidParam("messages", [], "must hold at least one message")
        for i, turn in enumerate(self.turns):
            if turn.role not in ROLES:
                raise InvalidParam(f"messages[{i}].role", turn.role, f"must be one of {', '.join(ROLES)}")
            for part in turn.parts:
                if isinstance(part, int) and not 0 <= part < len(self.images):
                    raise InvalidParam(f"messages[{i}].content", part, f"image index must be < {len(self.images)}")
                if isinstance(part, int) and turn.role != "user":
                    raise InvalidParam(
                        f"messages[{i}].content", "image_url", "images are accepted in user messages only"
                    )
        if self.turns[-1].role != "user":
            raise InvalidParam(
                f"messages[{len(self.turns) - 1}].role",
                self.turns[-1].role,
                "the last message must be the user's (the model answers it)",
            )
        if len(self.images) > max_images:
            raise InvalidParam("messages", f"<{len(self.images)} images>", f"at most {max_images} images per request")
        if self.max_tokens < 1:
            raise InvalidParam("max_tokens", self.max_tokens, "must be >= 1")
        if not 0 <= self.temperature <= 2:
            raise InvalidParam("temperature", self.temperature, "must be between 0 and 2")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", self.top_p, "must be > 0 and <= 1")


@dataclass
class ChatResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length | cancelled
    #: where its time to first token went (None: the engine does not say); not part of the answer's equality
    timing: ChatTiming | None = field(default=None, compare=False)
