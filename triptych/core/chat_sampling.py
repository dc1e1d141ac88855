"""How a chat answer is sampled, with its defaults written once: ``triptych chat``'s flags come from
``ChatSampling`` (``core.config_flags``), ``ChatParams`` takes its defaults from it, and the head's
``/v1/chat/completions`` uses the same default ``max_tokens``. Torch-free (the CLI builds its flags
before torch loads; the head imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatSampling:
    max_tokens: int = 256
    """Most tokens of the answer."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities add up to this."""
    seed: int = 0
    """Seed of the sampler (a seeded answer is the same every time)."""
