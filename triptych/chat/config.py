"""The built-in chat engine's settings (no torch: the command line builds it)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatEngineConfig:
    """An encoder instance's chat engine (``triptych.chat.engine.ChatEngine``)."""

    max_running_chats: int = 16
    """Chats that decode together, one batched forward per token; more wait in arrival order."""
    step_time_budget: float = 1.0
    """Vision encode and prefill a step runs beside the running chats' decode, as a multiple of the
    decode step's time (an EMA of the measured decode forwards): the work is admitted by its
    estimated time (an EMA of measured seconds per vision token and per prompt token,
    ``chat.budget``), images of one chat spread over steps, so the running chats keep their pace.
    The first prefilling chat always runs its next image or text chunk, even past the budget. With
    no chat decoding, admitted prompts prefill whole at once. 0: admission by the item counts
    ``prefill_tokens_per_step`` and ``prefill_images_per_step`` instead."""
    vision_call_stretch: float = 0.0
    """With the time budget: a step whose vision-tower run is estimated over its budget (one
    image's tower is atomic) runs the tower as one call over the images it must encode and the
    next ones waiting, while the call's estimate stays within (1 + this) times that of the images
    it must encode; priced with the tower's per-call overhead (fitted online from calls of
    different sizes), an overhead-bound tower so takes many images in one stall instead of one
    stall each, their prefill following in later chunks within the budget. The encoder layer's
    batched forward takes its images the same way. 0, the default (why: ``benchmarks/RESULTS.md``,
    "Vision flood"): a call holds only the images the step's chunks reach (the layer: those that
    fit the budget, the first one always)."""
    vision_thread: bool = False
    """Run a chat's vision tower (all its images, one call) on a thread of its own from its
    admission on, beside the engine's steps, so the running chats decode while it runs; its prompt
    is prefilled, within the step budget, once the embeddings are in. Off: each image's tower runs
    in the step whose chunk first touches it."""
    prefill_tokens_per_step: int = 64
    """Prompt tokens prefilled per engine step while chats are decoding, over all newly admitted
    chats (one batched forward), with ``step_time_budget`` 0: a long prompt (a chat with 8 images)
    is prefilled in chunks across steps, the running chats' decode in each. With the time budget,
    the most text tokens the first prefilling chat runs past the budget (its progress per step)."""
    prefill_images_per_step: int = 2
    """Images whose vision tower runs per engine step while chats are decoding, with
    ``step_time_budget`` 0 (a chunk stops before the next image past it). A joiner's processor
    (chat template, image preprocessing) runs on a thread of its own."""
    prefix_cache_mb: float = 64.0
    """Budget in MiB (2**20 bytes) of the chat prefix KV cache (prompt KV keyed by the token ids and
    the content hashes of the images in them); least recently used entries not in use are evicted
    past it. 0 turns it off."""

    def __post_init__(self) -> None:
        if isinstance(self.max_running_chats, bool) or not isinstance(self.max_running_chats, int):
            raise ValueError(f"ChatEngineConfig.max_running_chats={self.max_running_chats!r}: must be an integer")
        if self.max_running_chats < 1:
            raise ValueError(f"ChatEngineConfig.max_running_chats={self.max_running_chats}: must be >= 1")
        if isinstance(self.prefill_tokens_per_step, bool) or not isinstance(self.prefill_tokens_per_step, int):
            raise ValueError(
                f"ChatEngineConfig.prefill_tokens_per_step={self.prefill_tokens_per_step!r}: must be an integer"
            )
        if self.prefill_tokens_per_step < 1:
            raise ValueError(f"ChatEngineConfig.prefill_tokens_per_step={self.prefill_tokens_per_step}: must be >= 1")
        if isinstance(self.prefill_images_per_step, bool) or not isinstance(self.prefill_images_per_step, int):
            raise ValueError(
                f"ChatEngineConfig.prefill_images_per_step={self.prefill_images_per_step!r}: must be an integer"
            )
        if self.prefill_images_per_step < 1:
            raise ValueError(f"ChatEngineConfig.prefill_images_per_step={self.prefill_images_per_step}: must be >= 1")
        if isinstance(self.vision_call_stretch, bool) or not isinstance(self.vision_call_stretch, (int, float)):
            raise ValueError(f"ChatEngineConfig.vision_call_stretch={self.vision_call_stretch!r}: must be a number")
        if not (math.isfinite(self.vision_call_stretch) and 0 <= self.vision_call_stretch <= 100):
            raise ValueError(
                f"ChatEngineConfig.vision_call_stretch={self.vision_call_stretch}: must be in [0, 100] overheads"
            )
        if not isinstance(self.vision_thread, bool):
            raise ValueError(f"ChatEngineConfig.vision_thread={self.vision_thread!r}: must be true or false")
        if isinstance(self.step_time_budget, bool) or not isinstance(self.step_time_budget, (int, float)):
            raise ValueError(f"ChatEngineConfig.step_time_budget={self.step_time_budget!r}: must be a number")
        if not (math.isfinite(self.step_time_budget) and 0 <= self.step_time_budget <= 100):
            raise ValueError(
                f"ChatEngineConfig.step_time_budget={self.step_time_budget}: must be in [0, 100] decode steps "
                "(0 = admission by item counts)"
            )
        if not (isinstance(self.prefix_cache_mb, (int, float)) and math.isfinite(self.prefix_cache_mb)):
            raise ValueError(f"ChatEngineConfig.prefix_cache_mb={self.prefix_cache_mb!r}: must be a finite number")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"ChatEngineConfig.prefix_cache_mb={self.prefix_cache_mb}: must be >= 0 (0 = off)")

    @property
    def chat_slots(self) -> int:
        """Chats the head may route to one encoder at once: the running ones plus as many waiting
        (advertised in its ``Register``, apart from its encode slots)."""
        return 2 * self.max_running_chats

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_mb * (1 << 20))
