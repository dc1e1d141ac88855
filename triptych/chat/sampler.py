"""Next-token choice per chat: greedy, or temperature and top-p from the chat's own generator.

Each chat owns a ``torch.Generator`` seeded from its request, so its draws never depend on which
other chats share the batch. The processing matches transformers' ``generate`` for the settings
``ChatModel.generation_config`` makes: with ``ignore_eos`` the end-of-sequence tokens are masked
(``min_new_tokens``), then temperature, then top-p (transformers' own warpers).
"""

from __future__ import annotations

import torch
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from triptych.chat.params import GREEDY_BELOW, ChatParams


class Sampler:
    def __init__(self, params: ChatParams, eos: list[int], device):
        self.greedy = params.temperature < GREEDY_BELOW
        self.eos = torch.tensor(eos, device=device) if params.ignore_eos else None
        self.generator = None if self.greedy else torch.Generator(device=device).manual_seed(params.seed)
        self.warpers = [] if self.greedy else [TemperatureLogitsWarper(params.temperature)]
        if not self.greedy and params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits``: (vocab,) float scores of the next token."""
        scores = logits[None].float()
        if self.eos is not None:
            scores[:, self.eos] = -float("inf")
        if self.greedy:
            return int(scores.argmax(-1))
        for warp in self.warpers:
            scores = warp(None, scores)
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def pick(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """The next token of every row of ``logits`` (rows, vocab): the greedy rows in one argmax over
    the batch (their EOS masked where they ignore it), the sampled ones each from its own generator."""
    scores = logits.float().clone()
    for i, s in enumerate(samplers):
        if s.greedy and s.eos is not None:
            scores[i, s.eos] = -float("inf")
    best = scores.argmax(-1).tolist()
    return [best[i] if s.greedy else s(logits[i]) for i, s in enumerate(samplers)]
